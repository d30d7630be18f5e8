"""`tiered-cache cluster start | status | generate | stop` against a running Ray cluster.

Ray is imported only here (and in `workers/`), when one of these commands runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from tiered_cache.report.table import render_table
from tiered_cache.server.config import LOOPBACK


def add_parser(commands: Any) -> None:
    p = commands.add_parser("cluster", help="run tiered-cache on a Ray cluster (shards, workers, router)",
                            description="Start, inspect, use and stop tiered-cache's actors on a Ray cluster.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    start = _action(actions, "start", "start the directory, store shards, cache workers and router")
    start.add_argument("--config", help="cluster config YAML (see deploy/tiered-cache-cluster.yaml)")
    start.add_argument("--shards", type=int, help="store shards (overrides the config)")
    start.add_argument("--workers", type=int, help="cache workers (overrides the config)")
    start.add_argument("--model", help="worker model: smollm2 or a local Hugging Face folder")
    start.add_argument("--disk", help="shards' disk folder (each shard uses a sub-folder)")
    start.add_argument("--gpus", type=float, help="GPUs each worker holds (overrides worker.num_gpus)")
    start.add_argument("--device", choices=["auto", "cuda", "cpu"], help="where workers compute (worker.device)")
    start.add_argument("--start-timeout", type=float, help="seconds to wait for every actor (start_timeout_s)")
    start.add_argument("--kv-events", metavar="tcp://HOST:PORT",
                       help="workers and shards publish vLLM KV events from PORT up, two ports each (HOST auto: "
                            "each node's IP, beyond loopback; PORT 0: free ports); sets the router's policy to "
                            "events unless --policy says otherwise")
    start.add_argument("--policy", choices=["events", "prefix", "round_robin"],
                       help="how the router picks a worker (router.policy; default prefix, events with --kv-events)")
    start.add_argument("--engine", choices=["hf", "vllm"],
                       help="what computes: hf (our cache workers, the default) or vllm (Ray Serve LLM replicas "
                            "running vLLM with our connector, behind the OpenAI front end; needs vLLM and "
                            "ray[serve] in this Python: make install-vllm, then .venv-vllm/bin/tiered-cache)")
    start.add_argument("--replicas", type=int, help="vLLM replicas (vllm.replicas)")
    start.add_argument("--serve-router", choices=["tiered-cache", "prefix", "pow2"],
                       help="how Serve picks a vLLM replica (vllm.router; default tiered-cache)")
    start.add_argument("--no-connector", action="store_true",
                       help="vLLM replicas without our connector (vLLM's own prefix cache only)")
    start.add_argument("--serve", action="store_true",
                       help="also serve OpenAI-compatible /v1/completions and /v1/chat/completions (Ray Serve)")
    start.add_argument("--http-host", default="127.0.0.1",
                       help="address the HTTP front end listens on (default loopback; beyond it a token is needed)")
    start.add_argument("--http-port", type=int, default=8000, help="its port (default 8000)")
    start.add_argument("--http-token", help="bearer token every HTTP request must send (or TIERED_CACHE_HTTP_TOKEN)")
    _action(actions, "status", "each actor, its node, address and pages per tier")
    gen = _action(actions, "generate", "answer a prompt through the router")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, help="tokens to generate (default: the workers' setting)")
    gen.add_argument("--no-cache", action="store_true", help="prefill everything (the reference answer)")
    gen.add_argument("--http-token", help="engine vllm: the front end's bearer token (or TIERED_CACHE_HTTP_TOKEN)")
    _action(actions, "stop", "stop every actor and remove the shards' placement group")


def _action(actions: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    p = actions.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto, on a cluster node)")
    p.add_argument("--namespace", help="Ray namespace of the actors (default: the config's, else tiered-cache)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)
    return p


def _config(args: argparse.Namespace) -> Any:
    from tiered_cache.workers.config import ClusterConfig

    config = ClusterConfig.from_yaml(args.config) if getattr(args, "config", None) else ClusterConfig()
    changes: dict[str, Any] = {}
    if args.namespace:
        changes["namespace"] = args.namespace
    for name in ("shards", "workers"):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    worker = {name: getattr(args, flag) for name, flag in (("model", "model"), ("num_gpus", "gpus"),
                                                           ("device", "device"))
              if getattr(args, flag, None) is not None}
    if worker:
        changes["worker"] = dataclasses.replace(config.worker, **worker)
    vllm = {name: value for name, value in (("replicas", getattr(args, "replicas", None)),
                                            ("router", getattr(args, "serve_router", None)),
                                            ("model", getattr(args, "model", None)),
                                            ("connector", False if getattr(args, "no_connector", False) else None))
            if value is not None}
    if vllm:
        changes["vllm"] = dataclasses.replace(config.vllm, **vllm)
    if getattr(args, "engine", None):
        changes["engine"] = args.engine
    if getattr(args, "start_timeout", None) is not None:
        changes["start_timeout_s"] = args.start_timeout
    if getattr(args, "disk", None):
        changes["shard"] = dataclasses.replace(config.shard, disk_path=args.disk)
    if getattr(args, "kv_events", None):
        changes["kv_events"] = args.kv_events
    policy = getattr(args, "policy", None) or ("events" if getattr(args, "kv_events", None) else None)
    if policy:
        changes["router"] = dataclasses.replace(config.router, policy=policy)
    return config.replace(**changes) if changes else config


def _progress(action: str) -> Callable[[str], None]:
    """Progress lines go to stderr, so `--json` output stays parseable."""
    return lambda message: print(f"cluster {action}: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Stdout carries the command's answer only (`--json` is parsed by tools): what Ray prints on
    its own while the command runs (an actor's error, a shutdown notice) goes to stderr."""
    from tiered_cache.workers.cluster import stdout_for_the_answer

    answer = stdout_for_the_answer()
    code, text = _run(args)
    print(text, file=answer)
    return code


def _run(args: argparse.Namespace) -> tuple[int, str]:
    from tiered_cache.workers import cluster
    from tiered_cache.workers.serve_llm.settings import engine_missing

    config = _config(args)
    if args.action == "start" and config.engine.value == "vllm" and (missing := engine_missing()):
        raise ValueError(f"engine vllm: {missing}")
    cluster.connect(args.address, config.namespace)
    if args.action == "start":
        progress = _progress("start")
        infos = cluster.start(config, progress=progress)
        url = None
        token = args.http_token or os.environ.get("TIERED_CACHE_HTTP_TOKEN") or None
        if config.engine.value == "vllm":
            v = config.vllm
            progress(f"{v.replicas} vLLM replica(s) of {v.model} ({v.router.value} router, "
                     f"{'our connector over ' + str(config.shards) + ' shard(s)' if v.connector else 'no connector'})"
                     " through Ray Serve LLM: engines take minutes to start ...")
            shards = [i["address"] for i in infos if i["kind"] == "shard"]
            url = cluster.serve_vllm(config, shards, args.http_host, args.http_port, token)
            progress(f"OpenAI front end at {url} (/completions, /chat/completions, /models)"
                     + ("" if args.http_host in LOOPBACK else f": listening beyond loopback on {args.http_host}, "
                        "every request must send the token"))
        elif args.serve:
            url = cluster.serve_http(config, args.http_host, args.http_port, token)
            progress(f"HTTP front end at {url} (/completions, /chat/completions)"
                     + ("" if args.http_host in LOOPBACK else f": listening beyond loopback on {args.http_host}, "
                        "every request must send the token"))
        return 0, (json.dumps({"actors": infos, "http": url}, indent=2) if args.json
                   else render_actors(infos) + (f"\nHTTP: {url}" if url else ""))
    if args.action == "status":
        figures = cluster.stats()
        if not figures["actors"] and not figures["control"]:
            print(f"cluster status: no tiered-cache actors in Ray namespace {config.namespace!r} "
                  "(start them with `tiered-cache cluster start`, or name --namespace)", file=sys.stderr)
        return 0 if figures["actors"] else 1, json.dumps(figures, indent=2) if args.json else render_status(figures)
    if args.action == "generate":
        token = args.http_token or os.environ.get("TIERED_CACHE_HTTP_TOKEN") or None
        result = cluster.generate(args.prompt, args.max_new_tokens, use_cache=not args.no_cache, token=token)
        return 0, json.dumps(result, indent=2) if args.json else render_answer(result)
    stopped = cluster.stop(config.namespace, progress=_progress("stop"))
    return 0, json.dumps({"stopped": stopped}) if args.json else f"cluster stop: {len(stopped)} actor(s) stopped"


def node_label(actor: dict[str, Any]) -> str:
    """`IP node-id-tail`: nodes can share an IP (several on one machine), never a node id."""
    return f"{actor.get('node_ip', '')} {actor.get('node_id', '?')[-6:]}".strip()


def compute_label(actor: dict[str, Any]) -> str:
    """A worker's device and the GPUs Ray gave it: `cuda (GPU 0)`, `cpu`, `cpu (GPU 1)`."""
    if "device" not in actor:
        return "-"
    gpus = actor.get("gpu_ids") or []
    return f"{actor['device']} (GPU {', '.join(gpus)})" if gpus else actor["device"]


def render_actors(infos: list[dict[str, Any]]) -> str:
    rows = [[i["kind"], i["name"], node_label(i), compute_label(i), i.get("address", "-") or "-", events_label(i)]
            for i in infos]
    return render_table(rows, ["kind", "name", "node", "computes on", "address", "KV events"])


def events_label(actor: dict[str, Any]) -> str:
    """Where a shard publishes its KV events (`--kv-events`; a worker's are its address); "-"
    when it publishes none."""
    events = actor.get("events")
    return str(events["endpoint"]) if isinstance(events, dict) and events.get("endpoint") else "-"


def render_status(figures: dict[str, Any]) -> str:
    """One row per actor: node, address, how often Ray restarted it, and pages per tier."""
    from tiered_cache.workers.cluster import tiers_of

    rows = []
    for actor in figures["actors"]:
        restarted = _restarts(actor)
        if "error" in actor:
            rows.append([actor["kind"], actor["name"], "-", "-", "-", "-", restarted, f"unreachable: {actor['error']}"])
            continue
        pages = ", ".join(f"{t['name']} {int(t['pages']):,}" for t in tiers_of(actor))
        rows.append([actor["kind"], actor["name"], node_label(actor), compute_label(actor), actor.get("address", "-"),
                     events_label(actor), restarted, pages])
    rows += [[c["kind"], c["name"], "-", "-", "-", "-", _restarts(c), "-"] for c in figures.get("control", [])]
    table = render_table(rows, ["kind", "name", "node", "computes on", "address", "KV events", "restarts",
                                "pages per tier"])
    return "\n".join([table, *router_lines(figures)])


def router_lines(figures: dict[str, Any]) -> list[str]:
    """The router actor's figures, one line: policy, routes per worker and why, failures, and
    (routed by KV events) how often it fell back to the prefix policy."""
    router = next((c.get("figures") for c in figures.get("control", []) if c["kind"] == "router"), None)
    if router is None:
        return []
    if "error" in router:
        return [f"router: unreachable ({router['error']})"]
    routed = ", ".join(f"{w} {n:,}" for w, n in sorted(router.get("routed", {}).items())) or "none yet"
    reasons = ", ".join(f"{r} {n:,}" for r, n in sorted(router.get("reasons", {}).items())) or "-"
    line = (f"router ({router.get('policy', '?')}): routed {routed} (why: {reasons}); "
            f"in flight {sum(router.get('in_flight', {}).values()):,}; failures {router.get('failures', 0):,}")
    events = router.get("events")
    if isinstance(events, dict):
        line += f"; event fallbacks {events.get('fallbacks', 0):,}"
    return [line]


def _restarts(actor: dict[str, Any]) -> str:
    value = actor.get("restarts")
    return "?" if value is None else str(value)


def render_answer(result: dict[str, Any]) -> str:
    route = result["route"]
    where = ", ".join(f"{tier} {n:,}" for tier, n in result["sources"].items() if n) or "none"
    matched = f"{route['matched_tokens']:,} tokens expected cached" if "matched_tokens" in route \
        else f"{route['matched_chars']:,} chars matched"
    return (f"{result['text']}\n\n"
            f"worker {route['worker']} ({route['reason']}, {matched}); "
            f"reused {result['reused_tokens']:,} of {result['prompt_tokens']:,} prompt tokens (from {where}); "
            f"TTFT {result['ttft_s'] * 1e3:,.0f} ms")
