"""`TokenInterceptor`: with a token set, the store answers only calls that carry it (health
checks stay open); each refusal is counted."""

from __future__ import annotations

import hmac
from typing import Any

import grpc

from tiered_cache.server.requests import ServerCounters


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls to the store without `authorization: Bearer <token>` (health checks stay open)."""

    def __init__(self, token: str, counters: ServerCounters) -> None:
        self.expected = f"Bearer {token}".encode()
        self.counters = counters

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong token: send metadata `authorization: Bearer <token>`")
        # One denial per call shape, so the client sees UNAUTHENTICATED whatever it called.
        self._deny = {"/Put": grpc.stream_unary_rpc_method_handler(deny),
                      "/Get": grpc.unary_stream_rpc_method_handler(deny)}
        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        if details.method.startswith("/grpc.health."):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(sent).encode(), self.expected):
            return await continuation(details)
        self.counters.unauthenticated += 1
        return self._deny.get(details.method[details.method.rfind("/"):], self._deny_unary)
