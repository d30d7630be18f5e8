"""One streamed chat request against an OpenAI front end: time to its first token, its latency,
its text and usage (prompt, cached and output tokens), and our router's route where it says one
(the replica, why, what it expected there: the answer's route header)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.workers.names import ROUTE_HEADER, ROUTER_STATS_PATH


@dataclass
class Outcome:
    key: str
    ttft_s: float = 0.0
    latency_s: float = 0.0
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    route: dict[str, Any] = field(default_factory=dict)  # our router's, where it routed the request


def send(url: str, token: str | None, key: str, body: dict, timeout_s: float = 600.0) -> Outcome:
    """POST `body` to `url`/chat/completions and read its server-sent events."""
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{url}/chat/completions", json.dumps(body).encode(), headers)
    outcome = Outcome(key)
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            outcome.route = _route(answer.headers.get(ROUTE_HEADER))
            for raw in answer:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                _read_chunk(json.loads(line[5:]), outcome, started)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        detail = exc.read().decode(errors="replace")[:200] if isinstance(exc, urllib.error.HTTPError) else ""
        outcome.error = f"{type(exc).__name__}: {exc} {detail}".strip()
    outcome.latency_s = time.perf_counter() - started
    return outcome


def _route(header: str | None) -> dict[str, Any]:
    try:
        route = json.loads(header) if header else {}
    except ValueError:
        return {}
    return route if isinstance(route, dict) else {}


def _read_chunk(chunk: dict, outcome: Outcome, started: float) -> None:
    for choice in chunk.get("choices") or ():
        piece = (choice.get("delta") or {}).get("content") or ""
        if piece and not outcome.ttft_s:
            outcome.ttft_s = time.perf_counter() - started
        outcome.text += piece
    usage = chunk.get("usage")
    if usage:
        outcome.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        outcome.output_tokens = int(usage.get("completion_tokens") or 0)
        outcome.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def front_end_figures(url: str, token: str | None, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """Our request router's stats from the vLLM front end at OpenAI base `url` (the first of its
    routers: one per ingress process); None where it keeps none (another router, our HF front
    end) or does not answer."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url.removesuffix("/v1") + ROUTER_STATS_PATH, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            figures = json.loads(answer.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    routers = figures.get("routers") if isinstance(figures, dict) else None
    return routers[0] if routers else None
