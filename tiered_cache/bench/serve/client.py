"""One streamed chat request against an OpenAI front end: time to its first token, its latency,
its text and usage (prompt, cached and output tokens)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


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
