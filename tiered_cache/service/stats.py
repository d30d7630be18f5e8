"""A store server's figures as plain data (for `tiered-cache stats`, the demo and cluster shards)."""

from __future__ import annotations

from typing import Any


def server_stats(address: str, token: str | None, tls_ca: str | None, timeout: float) -> dict[str, Any]:
    """One server's figures as a dict, or {"address", "error"} when it cannot be reached."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from tiered_cache.service.client import StoreClient

    try:
        with StoreClient(address, token, tls_ca, timeout) as client:
            reply = client.stats()
    except grpc.RpcError as exc:
        return {"address": address, "error": f"{exc.code().name}: {exc.details()}"}
    data = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for tier in data["tiers"]:
        for key, value in tier.items():
            if key != "name":
                tier[key] = int(value)
        total = tier["hits"] + tier["misses"]
        tier["hit_rate"] = tier["hits"] / total if total else 0.0
    return {"address": address, **data}
