"""A store server's figures as plain data (for `tiered-cache stats`, the demo and cluster shards)."""

from __future__ import annotations

import contextlib
from typing import Any

from tiered_cache.wire.tls import TLS_HINT, tls_mismatch


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
        code, details = exc.code().name, exc.details() or ""
        if tls_mismatch(details):
            return {"address": address, "code": "TLS", "error": f"{code}: {details}; {TLS_HINT} (--tls-ca)"}
        hint = {"UNAUTHENTICATED": "; pass --token or set $TIERED_CACHE_SERVE_TOKEN",
                "PERMISSION_DENIED": "; this token's namespaces do not include the server's figures (an operator "
                                     "token, '*' in the token file, reads them)"}.get(code, "")
        return {"address": address, "error": f"{code}: {details}{hint}", "code": code}
    data = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _numbers(data.get("server", {}))
    for tier in data["tiers"]:
        _numbers(tier)
        total = tier["hits"] + tier["misses"]
        tier["hit_rate"] = tier["hits"] / total if total else 0.0
    return {"address": address, **data}
