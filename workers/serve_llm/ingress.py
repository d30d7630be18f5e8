"""The OpenAI front end of the vLLM replicas: Ray Serve LLM's own ingress (`OpenAiIngress`: the
completions, chat, models routes; vLLM's validation, so a bad request is a 400 naming what is
wrong), with what Ray's lacks in front of it:

- a bearer token on every request when one is set (Ray's ingress takes none); `cluster start`
  refuses to listen beyond loopback without one (http_frontend.start_proxy);
- a completion request's body read as JSON whatever its content type, one that is not a JSON
  object a 400 naming why;
- a non-streamed answer's `tiered_cache` field: the replica our router chose and why (a streamed
  one's `x-tiered-cache-route` header); a streamed answer's first-token time and usage taught to
  the router's estimate (prefill rate, service time, the store's cost);
- a request whose replica dies before answering, sent again to a live one; a stream whose replica
  dies mid-way, finished by a live one (resume.py);
- `GET /tiered-cache/router`: the request router's own figures in this ingress process (routes,
  in flight, fallbacks, the event sources it follows) and the requests sent again, for `stats --ray`.
"""

# No `from __future__ import annotations`: FastAPI reads the route's annotations at run time.
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.responses import Response

from tiered_cache.workers.http_frontend import token_refusal
from tiered_cache.workers.names import ROUTE_HEADER, ROUTER_STATS_PATH

RETRIES = 2  # times a request whose replica died is sent again
# Requests this process sent again after their replica died: whole, or a stream from where it stopped.
RETRIED = {"requests_sent_again": 0, "streams_resumed": 0}
log = logging.getLogger("tiered_cache.workers.serve_llm")


class BearerToken(BaseHTTPMiddleware):
    """A 401 (one line) for any request that does not send `Authorization: Bearer <token>`."""

    def __init__(self, app: Any, token: str) -> None:
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        refused = token_refusal(self.token, request.headers.get("authorization", ""))
        return refused if refused is not None else await call_next(request)


class RouteReport(BaseHTTPMiddleware):
    """A non-streamed answer's `tiered_cache` field: which replica our router chose, why, and the
    prompt tokens it expected from a cache (`usage.prompt_tokens_details.cached_tokens` says what
    came). Streamed answers and other routers' answers are left as they are."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        from tiered_cache.workers.serve_llm.request_router import route_of

        started = time.monotonic()
        response = await call_next(request)
        kind = response.headers.get("content-type", "")
        if not request.url.path.endswith("completions") or not ("event-stream" in kind or "json" in kind):
            return response
        request_id = request.headers.get("x-request-id", "")
        route = route_of(request_id)  # decided before the first byte of the answer
        if "event-stream" in kind:
            if route is not None:
                response.headers[ROUTE_HEADER] = json.dumps(route, separators=(",", ":"))
            response.body_iterator = _timed(response.body_iterator, request_id, started)  # type: ignore[attr-defined]
            return response
        body = b"".join([chunk async for chunk in response.body_iterator])  # type: ignore[attr-defined]
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        if route is None:
            return Response(body, response.status_code, headers)
        try:
            answer = json.loads(body)
        except ValueError:
            return Response(body, response.status_code, headers)
        if isinstance(answer, dict) and "usage" in answer:
            answer["tiered_cache"] = route
        return JSONResponse(answer, response.status_code, headers)


async def _timed(chunks: Any, request_id: str, started: float) -> Any:
    """A streamed answer passed on as it is, timed: its first token tells the router its prefill
    is done; its first token's time and its usage (the last chunk's, with
    `stream_options.include_usage`) teach the router's estimate."""
    first = 0.0
    usage: dict[str, Any] = {}
    async for chunk in chunks:
        text = chunk.decode(errors="replace") if isinstance(chunk, bytes) else str(chunk)
        if not first and has_token(text):
            first = time.monotonic() - started
            from tiered_cache.workers.serve_llm.request_router import first_token

            first_token(request_id)
        if '"usage":{' in text.replace(" ", ""):
            usage = _usage_of(text) or usage
        yield chunk
    if first and usage:
        from tiered_cache.workers.serve_llm.request_router import learn

        details = usage.get("prompt_tokens_details") or {}
        learn(request_id, {"ttft_s": first, "prompt_tokens": int(usage.get("prompt_tokens") or 0),
                           "reused_tokens": int(details.get("cached_tokens") or 0)}, time.monotonic() - started)


def _events(text: str) -> Iterator[dict[str, Any]]:
    """The JSON events of a stream's chunk (its `data:` lines; `[DONE]` and lines that do not parse
    skipped)."""
    for line in text.splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def has_token(text: str) -> bool:
    """Whether a stream's chunk carries generated text. Ray Serve LLM batches a stream's events
    into one chunk: the first holds the role's event (empty content) and the first token's
    together, so each event is read, not the chunk as a whole (else the first token is seen one
    engine step late, and under load a step can be a long prefill)."""
    for event in _events(text):
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")) or choice.get("text"):
                return True
    return False


def _usage_of(text: str) -> dict[str, Any] | None:
    return next((event["usage"] for event in _events(text) if event.get("usage")), None)


class JsonBody:
    """A completion request's body is JSON whatever its content type says (OpenAI's clients, and
    `curl -d`, do not always say it): one that is not a JSON object is a 400 naming why, before
    Ray's validation (which answers a body it cannot parse with a 500)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("completions"):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            parsed = json.loads(body or b"null")
            problem = None if isinstance(parsed, dict) else f"a JSON {type(parsed).__name__}, not an object"
        except (ValueError, UnicodeDecodeError) as exc:
            problem = f"not JSON ({exc})"
        if problem is not None:
            refused = JSONResponse({"error": {"message": f"the request body is {problem}", "type": "BadRequestError",
                                              "code": 400}}, status_code=400)
            await refused(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-type", b"content-length")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()  # the client's disconnect, when it comes
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, replay, send)


def routers() -> list[dict[str, Any]]:
    """The stats of this process's request routers (ours only: Ray's keep none we read)."""
    from tiered_cache.workers.serve_llm.request_router import ROUTERS

    return [r.stats() for r in ROUTERS]


def front_end_figures() -> dict[str, Any]:
    """This front end's figures: its request routers', and the requests it sent again."""
    return {"routers": routers(), "retried": dict(RETRIED)}


def router_stats() -> JSONResponse:
    return JSONResponse(front_end_figures())


class TieredCacheIngress(OpenAiIngress):
    """Ray's ingress, and the router's stats for a deployment handle (`stats --ray`). A request
    whose replica dies is sent again (`RETRIES` times; Serve has dropped the dead replica by then,
    so the router picks a live one): whole when nothing of its answer was sent yet, and a stream
    already under way from where it stopped (resume.py), where its token ids tell the whole
    answer; another stream under way fails."""

    async def _get_response(self, *, body: Any, call_method: str, raw_request: Any = None) -> Any:
        from ray.exceptions import ActorUnavailableError, RayActorError

        from tiered_cache.workers.serve_llm.resume import Transcript

        transcript = Transcript.of(body, call_method)
        asked = transcript.asked() if transcript is not None else body
        for attempt in range(RETRIES + 1):
            started = False
            try:
                async for response in super()._get_response(body=asked, call_method=call_method,
                                                             raw_request=raw_request):
                    started = True
                    yield transcript.passed(response) if transcript is not None else response
                return
            except (RayActorError, ActorUnavailableError) as exc:
                if attempt == RETRIES or (started and (transcript is None or not transcript.can_resume())):
                    raise
                if started and transcript is not None:
                    asked, call_method = transcript.continuation(), "completions"
                RETRIED["streams_resumed" if started else "requests_sent_again"] += 1
                log.warning("tiered-cache ingress: a replica died under a request (%s); %s",
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                            "asking a live one for the rest" if started else "sending it again")

    async def tiered_cache_figures(self) -> dict[str, Any]:
        return front_end_figures()


def ingress_app(token: str | None) -> FastAPI:
    """Ray Serve LLM's FastAPI app (its middleware: errors as JSON, request ids, metrics), our
    token check outermost, and the router's stats route."""
    from ray.llm._internal.serve.core.ingress.ingress import init

    app = init()
    app.add_api_route(ROUTER_STATS_PATH, router_stats, methods=["GET"])
    app.add_middleware(RouteReport)
    app.add_middleware(JsonBody)
    if token:
        app.add_middleware(BearerToken, token=token)  # added last: runs first
    return app
