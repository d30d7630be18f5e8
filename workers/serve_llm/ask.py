"""`ask`: one prompt through a running vLLM application's OpenAI front end, as `tiered-cache
cluster generate` answers it when the cluster runs `engine: vllm` (there is no router actor
then): streamed, so the time to first token is the one the user would see; the route from the
`x-tiered-cache-route` header our router's answers carry; the cached tokens from vLLM's usage.
The prompt is one user turn of the model's chat template, as our HF workers answer it (a model
without one gets the plain text). Errors are one line: no application, no token or a wrong one,
the front end unreachable."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from tiered_cache.workers.names import ROUTE_HEADER

DEFAULT_MAX_TOKENS = 64


class NoChatTemplate(RuntimeError):
    """The model has no chat template: the prompt goes as plain text."""


def ask(namespace: str, prompt: str, max_new_tokens: int | None = None, use_cache: bool = True,
        token: str | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """The answer to `prompt` from the vLLM application of Ray namespace `namespace`, shaped as
    the router actor's `generate` result (text, route, reused and prompt tokens, TTFT).
    `use_cache=False` sends a cache salt of its own: every token is computed (the reference)."""
    from tiered_cache.workers.serve_llm.app import running

    if not running(namespace):
        raise RuntimeError(f"no router and no vLLM application in namespace {namespace!r}: run "
                           "`tiered-cache cluster start` first")
    from tiered_cache.workers.http_frontend import base_url

    url = base_url("127.0.0.1", 8000)  # the running proxy's bind
    model = _get(url + "/models", token, timeout_s)["data"][0]["id"]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_new_tokens or DEFAULT_MAX_TOKENS, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if not use_cache:
        body["cache_salt"] = f"no-cache-{uuid.uuid4()}"
    started = time.perf_counter()
    try:
        answer = _open(url + "/chat/completions", token, timeout_s, body)
    except NoChatTemplate:
        body["prompt"] = body.pop("messages")[0]["content"]
        started = time.perf_counter()
        answer = _open(url + "/completions", token, timeout_s, body)
    with answer:
        route = json.loads(answer.headers.get(ROUTE_HEADER) or "{}")
        text, usage, ttft_s = [], {}, None
        for line in answer:
            data = line.decode().strip().removeprefix("data:").strip()
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and ttft_s is None:
                    ttft_s = time.perf_counter() - started
                text.append(piece)
            usage = chunk.get("usage") or usage
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"text": "".join(text), "prompt_tokens": int(usage.get("prompt_tokens", 0)), "reused_tokens": cached,
            "sources": {"cache": cached}, "ttft_s": ttft_s if ttft_s is not None else time.perf_counter() - started,
            "route": {"worker": route.get("replica", "?"), "reason": route.get("reason", "Serve's router"),
                      "matched_tokens": int(route.get("expected_cached_tokens", 0))}}


def _get(url: str, token: str | None, timeout_s: float) -> Any:
    with _open(url, token, timeout_s) as answer:
        return json.loads(answer.read())


def _open(url: str, token: str | None, timeout_s: float, body: dict[str, Any] | None = None) -> Any:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, json.dumps(body).encode() if body is not None else None, headers)
    try:
        return urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise RuntimeError("the vLLM front end wants its token: give --http-token or TIERED_CACHE_HTTP_TOKEN"
                               ) from None
        detail = exc.read().decode(errors="replace").strip().splitlines()
        if exc.code == 400 and detail and "chat template" in detail[0].lower():
            raise NoChatTemplate(detail[0]) from None
        raise RuntimeError(f"the vLLM front end answered {exc.code}: {detail[0][:300] if detail else exc.reason}"
                           ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"the vLLM front end at {url} is unreachable: {exc}") from None
