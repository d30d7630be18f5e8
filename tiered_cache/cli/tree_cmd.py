"""`tiered-cache tree`: the radix tree of a running cache, drawn in the terminal: an engine's own
cache through its metrics endpoint (`CacheConfig.metrics_port`: `--url`), or every cache worker
of a Ray cluster (`--ray`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, TextIO

from tiered_cache.report.tree import render_tree


def add_parser(commands: Any) -> None:
    p = commands.add_parser("tree", help="the radix tree of prefixes of a running cache",
                            description="Draw the radix tree of a running cache: shared prefixes as branches, "
                                        "pages and tokens per node, where they live, hits, idle time, text.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", "--url", dest="url", metavar="[http://]HOST:PORT",
                       help="an engine cache's metrics endpoint, e.g. 127.0.0.1:9100 (CacheConfig.metrics_port; "
                            "--url is the old spelling)")
    where.add_argument("--ray", metavar="ADDRESS", help="a Ray cluster running `tiered-cache cluster` (auto: "
                                                        "this node's): every worker's tree")
    p.add_argument("--namespace", default="tiered-cache", help="with --ray: the cluster's namespace "
                                                               "(default tiered-cache)")
    p.add_argument("--worker", help="with --ray: only this worker (e.g. worker-0)")
    p.add_argument("--token", help="with --address: the bearer token the endpoint requires "
                                   "(default $TIERED_CACHE_METRICS_TOKEN)")
    p.add_argument("--tokenizer", help="with --address: decode node text with this tokenizer (smollm2, or a "
                                       "Hugging Face model folder); default: token ids")
    p.add_argument("--max-nodes", type=int, default=500, help="draw at most this many nodes, the largest "
                                                              "branches first (default 500)")
    p.add_argument("--json", action="store_true", help="print the tree as JSON")
    p.set_defaults(run=run)


def _from_url(url: str, token: str | None, timeout_s: float = 10.0) -> dict[str, Any]:
    if "://" not in url:  # HOST:PORT, as every other command takes an address
        url = f"http://{url}"
    elif not url.startswith(("http://", "https://")):
        raise ValueError(f"--address {url}: an engine cache's metrics endpoint is http://HOST:PORT or HOST:PORT")
    base = url.rstrip("/").removesuffix("/metrics")
    request = urllib.request.Request(f"{base}/tree", headers={"authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
        return json.loads(body)
    except json.JSONDecodeError:
        start = body[:60].decode("utf-8", "replace").splitlines()[0] if body.strip() else "an empty body"
        raise RuntimeError(f"{base}/tree answered {start!r}, not a tree: is this an engine cache's metrics "
                           "endpoint (CacheConfig.metrics_port)? A store server's metrics have no tree") from None
    except urllib.error.HTTPError as exc:
        hint = "; pass --token" if exc.code == 401 else ""
        raise RuntimeError(f"{base}/tree answered {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"cannot reach {base}/tree: {getattr(exc, 'reason', exc)}; is the cache running "
                           f"with metrics_port set?") from None


def _decoder(name: str) -> Any:
    if name == "smollm2":
        from tiered_cache.integrations.smollm2 import load_tokenizer

        tokenizer = load_tokenizer()
    else:
        from transformers import AutoTokenizer

        # Local files only: a folder, or a Hub id already in the local cache. Where the Hub cannot
        # be reached the loader would retry for a minute before failing.
        try:
            tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(name), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"tokenizer {name!r}: not a local folder nor a Hub id in the local cache "
                               f"({type(exc).__name__}); give a folder, or smollm2") from None
    return tokenizer.decode


def _from_ray(address: str, namespace: str, worker: str | None, max_nodes: int) -> list[dict[str, Any]]:
    import ray

    from tiered_cache.workers import cluster
    from tiered_cache.workers.names import WORKER_PREFIX

    cluster.connect(address, namespace)  # after `stdout_for_the_answer` (run)
    names = [n for n in cluster.actor_names() if n.startswith(WORKER_PREFIX)]
    if worker is not None:
        if worker not in names:
            known = ", ".join(names) or "none"
            raise RuntimeError(f"no worker {worker!r} in namespace {namespace!r}; workers: {known}")
        names = [worker]
    if not names:
        raise RuntimeError(f"no cache worker in Ray namespace {namespace!r}: run `tiered-cache cluster start`")
    return ray.get([ray.get_actor(n).tree.remote(max_nodes) for n in names], timeout=60)


def run(args: argparse.Namespace) -> int:
    if args.max_nodes <= 0:
        raise ValueError(f"--max-nodes must be positive, got {args.max_nodes}")
    if args.url:
        view = _from_url(args.url, args.token or os.environ.get("TIERED_CACHE_METRICS_TOKEN"))
        if args.tokenizer:
            from tiered_cache.cache.tree_view import decode_previews

            decode_previews(view, _decoder(args.tokenizer))
        _print(args, [view], sys.stdout)
        return 0
    from tiered_cache.workers.cluster import stdout_for_the_answer

    out = stdout_for_the_answer()  # the trees alone on stdout, Ray's driver talking or not
    _print(args, _from_ray(args.ray, args.namespace, args.worker, args.max_nodes), out)
    return 0


def _print(args: argparse.Namespace, views: list[dict[str, Any]], out: TextIO) -> None:
    if args.json:
        print(json.dumps(views if args.ray else views[0], indent=2), file=out)
        return
    for view in views:
        print(render_tree(view, f"{view['worker']}:" if "worker" in view else ""), file=out)
