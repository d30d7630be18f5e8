"""The cluster's store shards where a replica's engine processes read them.

A vLLM replica's connector runs in the engine's own processes (scheduler and worker), which are
not Ray workers and cannot ask the cluster's directory. So the replica actor asks it every
`EVERY_S` and keeps the shards' addresses in a file on its node (`shard_list_path`), and the
connector follows that file (`remote_addresses_file`, cache/address_file.py): a shard that comes
back on another port, or a shard that joins, is used without redeploying the application. Every
replica on a node writes the same list, from the same directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from pathlib import Path

import ray

from tiered_cache.cache.address_file import write_addresses
from tiered_cache.workers.names import DIRECTORY

log = logging.getLogger("tiered_cache.workers.serve_llm")
EVERY_S = 2.0
ASK_TIMEOUT_S = 10.0
NAMESPACE_ENV = "TIERED_CACHE_CLUSTER_NAMESPACE"  # set on the replicas by cluster start


def shard_list_path(namespace: str) -> Path:
    """The file of cluster `namespace`'s shard addresses on this node."""
    return Path(tempfile.gettempdir()) / f"tiered-cache-{namespace}" / "shards"


async def directory_shards(namespace: str) -> list[str] | None:
    """The live shards' addresses the directory of cluster `namespace` lists; None when it does
    not answer."""
    try:
        directory = ray.get_actor(DIRECTORY, namespace=namespace)
        _, addresses = await asyncio.wait_for(directory.shards.remote(), ASK_TIMEOUT_S)
    except (ValueError, asyncio.TimeoutError, ray.exceptions.RayError) as exc:
        log.debug("tiered-cache: the cluster's directory did not answer: %s", exc)
        return None
    return list(addresses)


async def write_shard_list(namespace: str, deployed: list[str] | None = None) -> bool:
    """Ask the directory once and write what it lists. When it does not answer or lists no shard,
    `deployed` (the list the engines were deployed with, given at a replica's start) is written
    instead, so an engine about to start never reads a list an earlier deployment left; without
    it the file keeps the last list (the engines keep their ring). Whether the file was written."""
    addresses = await directory_shards(namespace) or deployed
    if not addresses:
        return False
    try:
        await asyncio.to_thread(write_addresses, shard_list_path(namespace), addresses)
    except OSError as exc:
        log.warning("tiered-cache: cannot write the shard list: %s", exc)
        return False
    return True


async def keep_shard_list(namespace: str) -> None:
    """Rewrite the list whenever the directory changes it (every `EVERY_S`), until cancelled;
    the replica wrote it once at start."""
    while True:
        await asyncio.sleep(EVERY_S)
        with contextlib.suppress(Exception):  # a bad round is skipped; the next one tries again
            await write_shard_list(namespace)


def cluster_namespace() -> str | None:
    return os.environ.get(NAMESPACE_ENV) or None
