"""A store server's figures as plain data (for `tiered-cache stats`, the demo and cluster shards)."""

from __future__ import annotations

import contextlib
from typing import Any

from tiered_cache.wire.options import DEFAULT_PORT


def normalize_address(address: str) -> str:
    """HOST:PORT with `serve`'s port when none is given ("localhost" would be port 443 to gRPC).
    Raises ValueError for a port that is not a number in 1..65535."""
    address = address.strip()
    if not address:
        raise ValueError("an empty --address: give HOST:PORT, e.g. 127.0.0.1:50551")
    if address.startswith("["):  # [IPv6] or [IPv6]:PORT
        host, _, rest = address.partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        host += "]"
    elif address.count(":") == 1:
        host, port = address.split(":")
    else:  # a bare IPv6 address or a host name
        host, port = (f"[{address}]" if ":" in address else address), ""
    if not port:
        return f"{host}:{DEFAULT_PORT}"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"port of {address!r} must be a number in 1..65535, got {port!r}")
    return f"{host}:{int(port)}"


def _numbers(data: dict[str, Any]) -> None:
    """int64 fields come out of MessageToDict as strings: make every figure a number."""
    for key, value in data.items():
        if isinstance(value, str) and key not in ("name", "version", "address"):
            try:
                data[key] = int(value)
            except ValueError:
                with contextlib.suppress(ValueError):
                    data[key] = float(value)


def server_stats(address: str, token: str | None, tls_ca: str | None, timeout: float) -> dict[str, Any]:
    """One server's figures as a dict, or {"address", "error", "code"} when it cannot be read
    (code: the gRPC status, e.g. UNAVAILABLE, UNAUTHENTICATED)."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from tiered_cache.client.store_client import StoreClient

    try:
        with StoreClient(address, token, tls_ca, timeout) as client:
            reply = client.stats()
    except grpc.RpcError as exc:
        code = exc.code().name
        hint = "; pass --token or set $TIERED_CACHE_SERVE_TOKEN" if code == "UNAUTHENTICATED" else ""
        return {"address": address, "error": f"{code}: {exc.details()}{hint}", "code": code}
    data = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _numbers(data.get("server", {}))
    for tier in data["tiers"]:
        _numbers(tier)
        total = tier["hits"] + tier["misses"]
        tier["hit_rate"] = tier["hits"] / total if total else 0.0
    return {"address": address, **data}
