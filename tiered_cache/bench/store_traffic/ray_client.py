"""One client of `bench store-traffic --ray`: a Ray actor (its own process, no CPU reserved) that sends
chat prompts through the router one after another for a phase, each with a deadline, and reports
what it saw. Several run at once, released together at a wall-clock time.

Only answered requests are timed; a failed one is counted by kind: "timeout" (no answer within
the deadline: the caller was not left hanging), or the error's own type name (NoWorkerError,
RayActorError, ...). Answers are kept per prompt (its SHA-256) so the driver can compare every
answer for a prompt with every other and with a recompute: a cache changes speed, never text.
Ray and `workers/` are imported inside the methods that use them, so `ChatReport` imports without
Ray.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.bench.store_traffic.chat import ChatConversations, ChatWorkload, prompt_id
from tiered_cache.bench.store_traffic.client import Timeline


@dataclass
class ChatReport:
    phase: str  # "recompute" (no cache: the baseline) or "cache"
    requests: Timeline = field(default_factory=Timeline)  # wall-clock start and seconds of each answer
    ttft_s: array = field(default_factory=lambda: array("d"))
    window: tuple[float, float] = (0.0, 0.0)  # released, last request ended (time.time)
    errors: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    reused_tokens: int = 0
    sources: Counter = field(default_factory=Counter)  # tier -> reused tokens
    routes: Counter = field(default_factory=Counter)  # worker -> requests
    answers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # prompt id -> first answer's tokens
    prompts: dict[str, str] = field(default_factory=dict)  # prompt id -> prompt, for the recompute check
    repeats: int = 0  # answers for a prompt this client had an answer for, compared with that one
    conflicts: int = 0  # of those, answers that differed


def error_kind(exc: BaseException) -> str:
    import ray

    if isinstance(exc, ray.exceptions.GetTimeoutError):
        return "timeout"
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the actor's own exception
    return type(cause if isinstance(cause, BaseException) else exc).__name__


class TrafficClient:
    def __init__(self, chat: ChatWorkload, index: int, timeout_s: float, max_new_tokens: int) -> None:
        import ray

        from tiered_cache.workers.names import ROUTER

        self.conversations = ChatConversations(chat, index)
        self.timeout_s, self.max_new_tokens = timeout_s, max_new_tokens
        self.router = ray.get_actor(ROUTER)
        self.counts = (0, 0)  # the running phase's requests and errors, for progress()

    def ready(self) -> bool:
        return bool(self.conversations.chat.system_prompts)  # the document read before the release

    def progress(self) -> tuple[int, int]:
        return self.counts

    def run(self, phase: str, use_cache: bool, release_at: float, duration_s: float) -> ChatReport:
        """Wait for `release_at` (time.time), then send requests until `duration_s` has passed."""
        import ray

        time.sleep(max(0.0, release_at - time.time()))
        report, started = ChatReport(phase), time.time()
        while time.time() < started + duration_s:
            prompt = self.conversations.next_prompt()
            begin = time.time()
            try:
                ref = self.router.generate.remote(prompt, self.max_new_tokens, use_cache)
                answer = ray.get(ref, timeout=self.timeout_s)
            except Exception as exc:  # counted; the next request goes on
                report.errors[error_kind(exc)] += 1
            else:
                report.requests.starts.append(begin)
                report.requests.latencies.append(time.time() - begin)
                self._record(report, prompt, answer)
            self.counts = (len(report.requests.starts), sum(report.errors.values()))
        report.window = (started, time.time())
        return report

    @staticmethod
    def _record(report: ChatReport, prompt: str, answer: dict[str, Any]) -> None:
        report.ttft_s.append(answer["ttft_s"])
        report.prompt_tokens += answer["prompt_tokens"]
        report.reused_tokens += answer["reused_tokens"]
        report.sources.update(answer.get("sources", {}))
        report.routes[answer["worker"]] += 1
        key, tokens = prompt_id(prompt), tuple(answer["tokens"])
        first = report.answers.setdefault(key, tokens)
        report.prompts.setdefault(key, prompt)
        if first is not tokens:
            report.repeats += 1
            report.conflicts += first != tokens
