"""KV event endpoints: `tcp://HOST:PORT`, loopback unless allowed (ZMQ carries no token, so anyone
who reaches the port reads which prefixes are cached), and the replay endpoint beside one."""

from __future__ import annotations

import ipaddress


def check_endpoint(endpoint: str, beyond_loopback: bool = False, allow: str = "allow it explicitly") -> str:
    """`tcp://HOST:PORT` (PORT 0: any free one) with HOST on loopback unless allowed; ValueError naming
    what is wrong otherwise. `allow`: how the caller's user allows it (a flag, a setting)."""
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ValueError(f"a KV events endpoint is tcp://HOST:PORT, got {endpoint!r}")
    host, _, port = endpoint[6:].rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"a KV events endpoint needs a port 0-65535, got {endpoint!r}")
    host = host.strip("[]")
    if not _loopback(host) and not beyond_loopback:
        raise ValueError(f"KV events endpoint {endpoint} listens beyond loopback: ZMQ has no token, so anyone who "
                         f"reaches it reads which prefixes are cached; use 127.0.0.1, or {allow}")
    if ":" in host:  # IPv6
        return f"tcp://[{host}]:{port}"
    return f"tcp://{'127.0.0.1' if host == 'localhost' else host}:{port}"


def on_loopback(endpoint: str) -> bool:
    """Whether a checked endpoint (`check_endpoint`'s answer) listens on loopback only."""
    return _loopback(endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]"))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def replay_endpoint_for(endpoint: str) -> str:
    """The replay endpoint beside `endpoint`: the next port (port 0: any free one)."""
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + 1 if int(port) else 0}"
