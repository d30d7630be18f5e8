"""`end_call`: end a call with a status, whether or not the client is still there to hear it.

When a client goes away (cancels, closes its channel) just as the server refuses its call, gRPC
fails to send the status and raises `ExecuteBatchError` from `abort`, which it then logs as an error
of the servicer. The client leaving is routine: it is raised as a cancellation, which the handlers
count and gRPC does not log.
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

import grpc
from grpc._cython import cygrpc


async def end_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """`context.abort(code, message)`; a call whose client has gone raises `CancelledError`."""
    try:
        await context.abort(code, message)
    except cygrpc.ExecuteBatchError as exc:
        raise asyncio.CancelledError(f"the client left before the status {code.name} reached it") from exc
    raise AssertionError("grpc's abort returned")  # abort always raises
