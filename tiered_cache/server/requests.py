"""What every handler of the store does with a call: count it, parse it, check it, refuse it, run
its store work on a thread pool, and count a stream that stalled.

Requests are parsed by our own deserializers, so a malformed message gets INVALID_ARGUMENT with
a message a person can act on (grpc's default answer to an unparsable request is a bare
INTERNAL). Every refusal is counted in the server's stats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from tiered_cache.server.admission import admitted_keys, admitted_namespace
from tiered_cache.server.config import ServerConfig
from tiered_cache.server.status import end_call
from tiered_cache.server.streams import StreamPermits
from tiered_cache.server.tenants import Grant
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire.deadline import ProgressDeadline
from tiered_cache.wire.framing import parse_page_blob
from tiered_cache.wire.namespaces import NAMESPACE_METADATA

T = TypeVar("T")
_log = logging.getLogger(__name__)


@dataclass
class Malformed:
    """What our deserializer returns for bytes that are not the expected message."""

    message_type: str
    size: int


def parse_put_item(data: bytes) -> Any:
    """A Put stream item (`PageBlob`), parsed by hand: one copy of the blob instead of two."""
    try:
        return parse_page_blob(data)
    except ValueError:
        return Malformed(pb.PageBlob.DESCRIPTOR.full_name, len(data))


def parser(message_cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError):
            return Malformed(message_cls.DESCRIPTOR.full_name, len(data))
    return parse


class ServerCounters:
    """Figures of the server itself. Only the event loop's thread changes them (no lock)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests = self.rejected = self.unauthenticated = self.refused_blobs = self.stalled_streams = 0
        self.cancelled_streams = 0  # Get/Put streams the client cancelled: routine, so counted, not logged
        self.shm_put_pages = 0  # Put pages read from clients' offered segments
        self.shm_pages = 0  # pages handed to same-host clients as refs into the arena (Lookup or Get)
        self.shm_pages_reused = 0  # of which already in the arena: handed out with no copy at all


class Requests:
    """The checks and pools the handlers share: `config`'s limits, the server's `counters`, the
    stream cap (`permits`), the `io` pool for Get and Put data and the `meta` pool for Lookup and
    Stats (so a Lookup never queues behind another client's multi-GiB Get)."""

    def __init__(self, config: ServerConfig, counters: ServerCounters, io: Executor, meta: Executor) -> None:
        self.config = config
        self.counters = counters
        self.permits = StreamPermits(config.max_streams)
        self.io = io
        self.meta = meta

    async def run(self, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def reject(self, context: grpc.aio.ServicerContext, message: str) -> None:
        self.counters.rejected += 1
        await end_call(context, grpc.StatusCode.INVALID_ARGUMENT, message)

    async def refuse_malformed(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Malformed):
            await self.reject(context, f"request is not a valid {request.message_type} ({request.size} bytes)")

    async def take_unary(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Count a keyless unary call (Stats, Attach, Offer); refuse it when it did not parse."""
        self.counters.requests += 1
        await self.refuse_malformed(request, context)

    async def check_keys(self, request: Any, context: grpc.aio.ServicerContext) -> list[bytes]:
        await self.refuse_malformed(request, context)
        try:
            return admitted_keys(request.keys, self.config.max_keys)
        except ValueError as exc:
            await self.reject(context, str(exc))
            raise  # reject aborts the call; this line is never reached

    async def namespace(self, context: grpc.aio.ServicerContext) -> str:
        """The namespace a call acts in (server/tenants.py, admission.py): the one its metadata
        names, else its token's first; a call whose token may not use the namespace it names is
        refused (PERMISSION_DENIED), one that names no usable namespace too (INVALID_ARGUMENT)."""
        metadata = dict(context.invocation_metadata() or ())
        asked = metadata.get(NAMESPACE_METADATA)
        try:
            return admitted_namespace(self.config.grants, metadata.get("authorization", ""),
                                      None if asked is None else str(asked), f"metadata {NAMESPACE_METADATA}:")
        except ValueError as exc:
            await self.reject(context, str(exc))
            raise  # reject aborts the call; this line is never reached
        except PermissionError as exc:
            self.counters.rejected += 1
            await end_call(context, grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise  # abort raises; this line is never reached

    async def require_operator(self, context: grpc.aio.ServicerContext, what: str) -> None:
        """Refuse (PERMISSION_DENIED) a call showing `what` of every namespace unless its token may
        use every namespace ('*' in the token file, or the one `--token`): a tenant sees its own
        pages, not how busy or full the others are."""
        if not self.config.grants:
            return
        grant = self._grant(dict(context.invocation_metadata() or ()))
        if grant is not None and not grant.every:
            self.counters.rejected += 1
            await end_call(context, grpc.StatusCode.PERMISSION_DENIED,
                                f"{what} shows every namespace: it needs an operator's token ('*' in the token file)")

    def _grant(self, metadata: dict[str, Any]) -> Grant | None:
        """What the call's token may do (None: a token the server does not know; the interceptor
        has refused those already)."""
        return self.config.grants.grant_for(metadata.get("authorization", ""))

    def count_cancelled(self, method: str) -> None:
        """A client cancelled its stream (it stopped reading a Get it had enough of, or went away):
        counted, and logged at debug level only, so real errors stay visible."""
        self.counters.cancelled_streams += 1
        _log.debug("a client cancelled its %s stream", method)

    def count_stalled(self, context: grpc.aio.ServicerContext, watch: ProgressDeadline) -> None:
        """A stream made no progress: count it and say why in its status, if one can still be
        sent (a client that reads nothing gets the stream reset instead)."""
        self.counters.stalled_streams += 1
        context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
        context.set_details(f"{watch.what} for {watch.idle_s:g} s: stream ended (the server's stream_idle_s)")
