"""`TTFTEstimate`: what the event router expects a worker's time to first token to be.

A prompt's leading pages may be on the worker's device, in its host RAM (a copy up), in the store
(a load over the network) or nowhere (recomputed); wherever they were found they are not free
(the prefill of the rest attends over them, and the engine steps each request it runs); a busy
worker first finishes what it is doing. Each cost is a moving estimate learned from the answers
the router relays: seconds per recomputed token from answers that reused little, a cached
token's share of a recomputed one's from answers that found their pages on the device, per host
or store token from the rest of the TTFT once those parts are taken out, and a request's time
after its first token. Where the engines time their own loads (our vLLM connector does), the
store's rate is what they timed (`loads_timed`), not that rest: the rest holds whatever the
router did not expect (a wait behind a prefill it did not know of), which one answer would
teach as the store's cost. Where the engines time a prefill of their own at start (our Ray
Serve replicas do: a prompt, then the same prompt again with its end new), those are the first
samples of the prefill's rate and of a cached token's share (`prefill_timed`; the share then
learns from no answer): a loaded cluster's first routes are decided long before the first answer
comes back, and a prior that is several times off sends them where they wait.
A queued request waits for the work ahead of it: the router adds up what it expected of each
request it sent there (its own loads and prefill, then its decode), and `service_s` for any it
did not cost. Until answers teach it, the priors hold (recompute dearest, host RAM cheapest);
they are a guess, not a measurement: a rate's first samples from answers that waited behind no
one are averaged as they come (the first replaces the prior), and only after `1 / _WEIGHT` of
them does it move as a moving average. An answer that waited moves a rate a step at most: what
the router took out for its wait was itself an estimate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.tiers.base import Tier

_WEIGHT = 0.2  # of each new sample in the moving estimates
AHEAD_AT_MOST = 0.25  # of a TTFT expected to be waiting, for it to teach the rates


@dataclass
class TTFTEstimate:
    prefill_s_per_token: float = 2e-3
    # A cached token against one computed: a request that finds a long prefix still takes time
    # in the engine's step, and requests piled on the worker that holds it wait for each other (a
    # hit with 1.4K tokens cached took 15-20% of a prefill of them on the development box).
    cached_share: float = 0.1
    host_s_per_token: float = 2e-5
    store_s_per_token: float = 1e-4
    service_s: float = 0.5  # one request on a worker, answer included (for requests whose cost is unknown)
    decode_s: float = 0.1  # one request's time after its first token
    samples: int = 0
    store_timed: bool = False  # the store's rate comes from the engines' own load times
    prefill_probes: int = 0  # the engines' own prefills at start that taught the prefill's rate
    share_timed: bool = False  # a cached token's share comes from the engines' own hits at start
    _seen: dict[str, int] = field(default_factory=dict, repr=False)  # samples per rate

    def seconds(self, prompt_tokens: int, device: int, host: int, store: int, wait_s: float = 0.0) -> float:
        """Expected TTFT on a worker with `device`, then `host`, then `store` leading tokens of a
        `prompt_tokens` prompt (each run after the one before), after `wait_s` of work ahead of it."""
        computed = max(0, prompt_tokens - device - host - store)
        cached = prompt_tokens - computed
        return (wait_s + host * self.host_s_per_token + store * self.store_s_per_token
                + (computed + cached * self.cached_share) * self.prefill_s_per_token)

    def compute_s(self, prompt_tokens: int, cached: int) -> float:
        """The prefill the worker would spend on the uncached tokens: time taken from whatever
        queues behind this request there."""
        return max(0, prompt_tokens - cached) * self.prefill_s_per_token

    def observe(self, answer: Mapping[str, Any], latency_s: float) -> None:
        """Learn from one answer (`CacheWorker.generate`'s: ttft_s, prompt_tokens, reused_tokens,
        sources: tier -> tokens; queued_s, its wait outside the TTFT; ahead_s, the wait the
        router expected inside it) and its latency as the router saw it."""
        ttft = float(answer.get("ttft_s") or 0.0)
        prompt = int(answer.get("prompt_tokens") or 0)
        sources: Mapping[str, int] = answer.get("sources") or {}
        if ttft <= 0 or prompt <= 0:
            return
        self.samples += 1
        # The worker's own time on it: the router's latency less the wait behind requests ahead
        # (counted by `in_flight` already), else a busy cluster would count its queues twice.
        busy = max(latency_s - float(answer.get("queued_s") or 0.0), ttft)
        self.service_s = self._moved("service_s", busy)
        self.decode_s = self._moved("decode_s", busy - ttft)
        # An engine that queues inside itself (vLLM) times the wait in its TTFT: the router takes
        # out what it expected ahead, and learns no rate from a TTFT that was mostly waiting.
        ahead = float(answer.get("ahead_s") or 0.0)
        if ahead > AHEAD_AT_MOST * ttft:
            return
        ttft -= ahead
        clean = ahead == 0  # nothing was expected ahead of it: its TTFT is its own work
        computed = prompt - int(answer.get("reused_tokens") or 0)
        host, store = int(sources.get(Tier.HOST, 0)), int(sources.get(Tier.REMOTE, 0))
        if computed >= prompt // 2:  # mostly recomputed: the prefill rate shows (loads are a small part)
            self.prefill_s_per_token = self._moved("prefill_s_per_token", ttft / computed, clean)
            return
        rest = max(0.0, ttft - computed * self.prefill_s_per_token)
        cached = prompt - computed
        if not host and not store:  # all on the device: the rest is what its cached tokens cost
            if not self.share_timed:  # else the engines timed it: the rest holds waits, as for loads
                share = min(1.0, rest / (cached * self.prefill_s_per_token))
                self.cached_share = self._moved("cached_share", share, clean)
            return
        loading = max(0.0, rest - cached * self.cached_share * self.prefill_s_per_token)
        # A load that seems dearer than recomputing is queueing the wait left in its TTFT (the
        # engine loads whatever the tiers hold, and loads exist because they beat recompute):
        # taught as is, one such answer would keep the router off the store for good.
        dearest = (1 - self.cached_share) * self.prefill_s_per_token
        if store and not host and not self.store_timed:
            self.store_s_per_token = self._moved("store_s_per_token", min(loading / store, dearest), clean)
        elif host and not store:
            self.host_s_per_token = self._moved("host_s_per_token", min(loading / host, dearest), clean)

    def loads_timed(self, seconds: float, tokens: int) -> None:
        """The engines' own timing of loads from the store: their forward steps waited `seconds`
        for `tokens` more tokens loaded. From the first, the store's rate is learned from these
        alone (the first replaces the prior and whatever TTFTs taught)."""
        if tokens <= 0 or seconds < 0:
            return
        if not self.store_timed:
            self.store_timed, self._seen["store_s_per_token"] = True, 0
        self.store_s_per_token = self._moved("store_s_per_token", seconds / tokens)

    def prefill_timed(self, seconds: float, tokens: int, hit_seconds: float = 0.0, cached: int = 0) -> None:
        """An engine's own prefill of `tokens` (none cached, nothing else running) took `seconds`,
        and the same prompt with `cached` of its tokens in the engine's prefix cache took
        `hit_seconds`: a sample of the prefill's rate (as an answer that waited behind no one is)
        and one of a cached token's share of it: what the hit took beyond computing its new
        tokens (the engine's own time per request counts in it). From the first timed hit, the
        share is learned from these alone: what a device hit's TTFT leaves once its prefill is
        taken out holds every wait the router did not expect, as with the store's loads."""
        if tokens <= 0 or seconds <= 0:
            return
        self.prefill_probes += 1
        rate = seconds / tokens
        self.prefill_s_per_token = self._moved("prefill_s_per_token", rate)
        if 0 < cached < tokens and hit_seconds > 0:
            share = max(0.0, hit_seconds - (tokens - cached) * rate) / (cached * rate)
            if not self.share_timed:  # the first timed hit replaces the prior and what answers taught
                self.share_timed, self._seen["cached_share"] = True, 0
            self.cached_share = self._moved("cached_share", min(1.0, share))

    def to_dict(self) -> dict[str, float]:
        return {"prefill_s_per_token": self.prefill_s_per_token, "cached_share": self.cached_share,
                "prefill_probes": self.prefill_probes, "share_timed": self.share_timed,
                "host_s_per_token": self.host_s_per_token,
                "store_s_per_token": self.store_s_per_token, "store_timed": self.store_timed,
                "service_s": self.service_s, "decode_s": self.decode_s, "samples": self.samples}

    def _moved(self, name: str, sample: float, clean: bool = True) -> float:
        """Rate `name` with one more sample: the mean of its `clean` samples so far (the prior
        counts for none), then (past `1 / _WEIGHT` of them) a moving average; a sample that is not
        `clean` moves it by the moving average's step."""
        if not clean:
            return (1 - _WEIGHT) * getattr(self, name) + _WEIGHT * sample
        seen = self._seen[name] = self._seen.get(name, 0) + 1
        weight = max(_WEIGHT, 1.0 / seen)
        return (1 - weight) * getattr(self, name) + weight * sample


def with_store_share(answer: Mapping[str, Any], expected: tuple[int, int, int], ahead_s: float = 0.0
                     ) -> dict[str, Any]:
    """`answer` with the tokens it took from the store, for an engine that tells only how many
    prompt tokens came from any cache (vLLM's `cached_tokens`): what it reused beyond the tokens
    expected on the worker's device, up to those expected in the store (`Decision.expected`);
    and the work the router expected ahead of it inside its TTFT (`Decision.wait_s`)."""
    device, _, store = expected
    from_store = max(0, min(int(answer.get("reused_tokens") or 0) - device, store))
    return {**answer, "sources": {Tier.REMOTE: from_store} if from_store else {}, "ahead_s": ahead_s}
