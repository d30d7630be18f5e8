"""Where each cluster member publishes its KV events (`ClusterConfig.kv_events`).

One setting for the whole cluster, `tcp://HOST:PORT`: member slot i (workers first, then shards)
binds PORT + 2i and its replay endpoint the port after (PORT 0: free ports, announced through
the directory). HOST `auto` is each member's node IP, so a router on another node reaches it:
beyond loopback, which ZMQ guards with no token, so it is allowed only when asked for this way.
"""

from __future__ import annotations

from tiered_cache.events.endpoints import check_endpoint

AUTO = "auto"


def member_endpoints(template: str, slot: int, node_ip: str) -> tuple[str, str, bool]:
    """(endpoint, replay endpoint, beyond loopback) of member `slot` under `template`."""
    host, _, port = template.removeprefix("tcp://").rpartition(":")
    beyond = host == AUTO
    host = node_ip if beyond else host
    base = int(port)
    endpoint = check_endpoint(f"tcp://{host}:{base + 2 * slot if base else 0}", beyond)
    replay = check_endpoint(f"tcp://{host}:{base + 2 * slot + 1 if base else 0}", beyond)
    return endpoint, replay, beyond


def check_template(template: str) -> str:
    """`template` checked (ValueError naming what is wrong), HOST `auto` allowed."""
    if not template.startswith("tcp://"):
        raise ValueError(f"kv_events is tcp://HOST:PORT (HOST auto: each node's IP), got {template!r}")
    host, _, port = template.removeprefix("tcp://").rpartition(":")
    check_endpoint(f"tcp://{'127.0.0.1' if host == AUTO else host}:{port}",
                   allow="HOST auto (each node's IP: the events listen beyond loopback there)")
    return template
