"""The OpenAI-compatible HTTP front end (`tiered-cache cluster start --serve`): a Ray Serve
application with `/v1/completions` and `/v1/chat/completions` (streamed too, as server-sent
events) that sends every request through the prefix-aware router, so a prompt goes to the worker
most likely to hold its prefix.

- Greedy decoding only: a request asking for sampling (temperature > 0, n > 1) is refused rather
  than answered otherwise than asked.
- `usage.prompt_tokens_details.cached_tokens` is how many prompt tokens came from the cache; the
  `tiered_cache` field says from which tier, which worker and why it was chosen. `"cache":
  false` in a request computes everything (a reference answer).
- Bad requests (malformed JSON, a prompt past the model's context, an unknown field type) get a
  400 with a one-line message; no live worker, a 503.
- It listens on loopback unless `--http-host` says otherwise; beyond loopback it needs a bearer
  token (`--http-token` or TIERED_CACHE_HTTP_TOKEN), checked on every request.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (`Request`)
# at run time, and Serve's ingress rebinds them where string annotations do not resolve.
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from tiered_cache.integrations.chat_messages import checked_messages
from tiered_cache.server.config import LOOPBACK
from tiered_cache.workers.names import ROUTER, http_app_name

api = FastAPI(title="tiered-cache", docs_url=None, redoc_url=None)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class BadRequest(ValueError):
    """A request this server refuses, with the reason (a 400)."""


def deploy(namespace: str, model: str, host: str = "127.0.0.1", port: int = 8000,
           token: str | None = None) -> str:
    """Start Ray Serve's HTTP proxy on `host:port` (if Serve is not running yet) and the front end
    for the cluster in `namespace` with `token`; returns the base URL the running proxy answers on.

    Run again (`cluster start` is idempotent), it never changes what is served silently: Serve's
    proxy cannot move while it runs, so another host or port is refused in one line naming both;
    the same bind redeploys the front end with this token for real. ValueError for a bind beyond
    loopback without a token: it would serve anyone who reaches the port."""
    start_proxy(host, port, token)
    serve.run(OpenAIFrontend.bind(namespace, model, token), name=http_app_name(namespace), route_prefix="/")
    return base_url(host, port)


def start_proxy(host: str, port: int, token: str | None) -> None:
    """Serve's HTTP proxy on `host:port`, started unless it runs there already. ValueError for a
    bind beyond loopback without a token, or a proxy running on another bind (it cannot move)."""
    if host not in LOOPBACK and not token:
        raise ValueError(f"--http-host {host} listens beyond loopback: give a token (--http-token or "
                         "TIERED_CACHE_HTTP_TOKEN) that every request must send")
    running = running_bind()
    if running is not None and running != (host, port):
        raise ValueError(f"the HTTP front end already listens on {_url_host(running[0])}:{running[1]}, not "
                         f"{_url_host(host)}:{port}: a running proxy cannot move; give --http-host {running[0]} "
                         f"--http-port {running[1]}, or `tiered-cache cluster stop` first")
    if running is None:
        serve.start(http_options={"host": host, "port": port})


def delete_app(name: str) -> bool:
    """Delete the Serve application `name`, and Serve with it when no other application is left.
    False when there was none (Serve not running)."""
    if running_bind() is None:
        return False
    apps = serve.status().applications
    if name not in apps:
        return False
    serve.delete(name)
    if set(apps) == {name}:
        serve.shutdown()
    return True


def base_url(host: str, port: int) -> str:
    """The OpenAI base URL of the running proxy (`host:port` when it is not running)."""
    bound = running_bind() or (host, port)
    return f"http://{_url_host(bound[0])}:{bound[1]}/v1"


def running_bind() -> tuple[str, int] | None:
    """(host, port) of the running Serve HTTP proxy, read from Serve's controller; None when Serve
    is not running."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None
    options = ray.get(controller.get_http_config.remote(), timeout=30)
    return str(options.host), int(options.port)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def token_refusal(token: str | None, authorization: str) -> Response | None:
    """A 401 unless the request's Authorization header is `Bearer <token>` (no token: none)."""
    if token is None or hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
        return None
    return _error(401, "missing or wrong bearer token (Authorization: Bearer ...)", "authentication_error")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def read_request(body: dict[str, Any], chat: bool) -> tuple[Any, int, bool, bool]:
    """(prompt or messages, max tokens, stream, use the cache) from an OpenAI request body;
    BadRequest names the first field that is wrong."""
    if chat:
        try:
            prompt = checked_messages(body.get("messages"))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    temperature = body.get("temperature", 0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature != 0:
        raise BadRequest(f"this server decodes greedily: temperature must be 0, got {temperature!r}")
    if body.get("n", 1) != 1:
        raise BadRequest(f"n must be 1 (one greedy answer), got {body.get('n')!r}")
    stream, use_cache = body.get("stream", False), body.get("cache", True)
    if not isinstance(stream, bool) or not isinstance(use_cache, bool):
        raise BadRequest("stream and cache must be true or false")
    return prompt, max_tokens, stream, use_cache


def finish_reason(answer: dict[str, Any], max_tokens: int) -> str:
    return "length" if len(answer["tokens"]) >= max_tokens else "stop"


def usage(answer: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = int(answer["prompt_tokens"]), len(answer["tokens"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(answer["reused_tokens"])}}


def response_body(answer: dict[str, Any], rid: str, model: str, chat: bool, max_tokens: int) -> dict[str, Any]:
    """The non-streamed answer, in OpenAI's shape, with what the cache did beside it."""
    reason = finish_reason(answer, max_tokens)
    choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": answer["text"]},
                               "finish_reason": reason} if chat else
                              {"index": 0, "text": answer["text"], "finish_reason": reason, "logprobs": None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(answer), "tiered_cache": cache_report(answer)}


def chunk_body(rid: str, model: str, chat: bool, text: str, reason: str | None = None,
               totals: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = ({"index": 0, "delta": {"content": text} if text or reason is None else {},
                               "finish_reason": reason} if chat else
                              {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}
    if totals is not None:
        body["usage"] = totals
    return body


def cache_report(answer: dict[str, Any]) -> dict[str, Any]:
    return {"worker": answer.get("worker"), "route": answer.get("route"), "sources": answer.get("sources", {}),
            "reused_tokens": answer.get("reused_tokens", 0), "ttft_s": answer.get("ttft_s")}


async def _next(items: Any) -> dict[str, Any] | None:
    try:
        ref = await items.__anext__()
    except StopAsyncIteration:
        return None
    return await ref


def _event(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


# Last in the module: Serve serializes the class when it is decorated, with the module's functions
# it calls, so they must exist by then.
@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
@serve.ingress(api)
class OpenAIFrontend:
    def __init__(self, namespace: str, model: str, token: str | None = None) -> None:
        self.router = ray.get_actor(ROUTER, namespace=namespace)
        self.model = model
        self.token = token

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model",
                                                         "owned_by": "tiered-cache"}]})

    async def _serve(self, request: Request, chat: bool) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            body = parse_body(await request.body())
            prompt, max_tokens, stream, use_cache = read_request(body, chat)
            call = (prompt, max_tokens, use_cache, chat)
            if not stream:
                return JSONResponse(response_body(await self.router.generate.remote(*call), self._id(chat),
                                                  self.model, chat, max_tokens))
            items = self.router.stream.remote(*call)
            first = await _next(items)  # a refused prompt is a 400 here, before any byte is sent
            return StreamingResponse(self._events(first, items, chat, max_tokens), media_type="text/event-stream")
        except BadRequest as exc:
            return _error(400, str(exc), "invalid_request_error")
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ValueError):
                return _error(400, str(cause).splitlines()[0], "invalid_request_error")
            if type(cause).__name__ == "NoWorkerError":
                return _error(503, str(cause).splitlines()[0], "unavailable")
            raise

    async def _events(self, first: dict[str, Any] | None, items: Any, chat: bool,
                      max_tokens: int) -> AsyncIterator[bytes]:
        rid, item = self._id(chat), first
        if chat:  # OpenAI's first chunk names the speaker
            yield _event({**chunk_body(rid, self.model, chat, ""), "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        while item is not None:
            if "token" in item:
                yield _event(chunk_body(rid, self.model, chat, item["text"]))
            else:  # the whole answer: the finish reason and usage, then the end
                yield _event(chunk_body(rid, self.model, chat, "", finish_reason(item, max_tokens), usage(item)))
            item = await _next(items)
        yield b"data: [DONE]\n\n"

    def _refused(self, request: Request) -> Response | None:
        return token_refusal(self.token, request.headers.get("authorization", ""))

    @staticmethod
    def _id(chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
