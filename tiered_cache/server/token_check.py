"""`TokenInterceptor`: with tokens set, the store answers only calls that carry one of them
(health checks stay open); each refusal is counted. Which namespaces a known token may use is
checked by the handlers (`Requests.namespace`)."""

from __future__ import annotations

from typing import Any

import grpc

from tiered_cache.server.requests import ServerCounters
from tiered_cache.server.status import end_call
from tiered_cache.server.tenants import Grants


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls to the store without `authorization: Bearer <token>` of a known token (health
    checks stay open)."""

    def __init__(self, grants: Grants, counters: ServerCounters) -> None:
        self.grants = grants
        self.counters = counters

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await end_call(context, grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong token: send metadata `authorization: Bearer <token>`")
        # One denial per call shape, so the client sees UNAUTHENTICATED whatever it called.
        self._deny = {"/Put": grpc.stream_unary_rpc_method_handler(deny),
                      "/Get": grpc.unary_stream_rpc_method_handler(deny)}
        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        if details.method.startswith("/grpc.health."):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if self.grants.grant_for(sent) is not None:
            return await continuation(details)
        self.counters.unauthenticated += 1
        return self._deny.get(details.method[details.method.rfind("/"):], self._deny_unary)
