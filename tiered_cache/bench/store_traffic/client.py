"""One client process of `bench store-traffic`: a `StoreClient` (so every failure shows its gRPC status)
with a deadline on each call, first in the baseline (a 1-key Lookup again and again), then in
the mix: each request Looks up a conversation's pages, Gets the leading held ones and checks
each blob byte for byte against the blob its key must hold, then Puts the rest (the turn's new
pages, and any the store no longer held, recomputed as an engine would).

Only calls that succeed are timed; a failed one is counted by kind: its gRPC status code name,
"stalled" (a stream's progress deadline passed), "wrong_bytes" (a Get returned a blob that is
not the one put for its key, a key not asked for, or one out of order), "put refused (REASON)"
per page the server refused; a baseline call's kind is prefixed "baseline ".
"""

from __future__ import annotations

import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.bench.store_traffic.workload import Conversations, PagePayloads, Workload
from tiered_cache.client.store_client import StoreClient
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire.deadline import StreamStalled

OPS = ("lookup", "get", "put")


@dataclass
class Timeline:
    """Start (time.monotonic, one clock for every process on the host) and seconds of each call."""

    starts: array = field(default_factory=lambda: array("d"))
    latencies: array = field(default_factory=lambda: array("d"))

    def add(self, start: float) -> None:
        self.starts.append(start)
        self.latencies.append(time.monotonic() - start)

    @classmethod
    def merged(cls, timelines: list[Timeline]) -> Timeline:
        out = cls()
        for t in timelines:
            out.starts.extend(t.starts)
            out.latencies.extend(t.latencies)
        return out


@dataclass
class ClientReport:
    baseline: Timeline
    baseline_window: tuple[float, float]
    ops: dict[str, Timeline]
    window: tuple[float, float]  # released, last call ended
    errors: Counter
    requests: int = 0
    pages_compared: int = 0
    pages_missing: int = 0  # held at the Lookup, gone at the Get (evicted in between)
    pages_put: int = 0
    new_pages: int = 0


@dataclass(frozen=True)
class ClientArgs:
    address: str
    workload: Workload
    index: int
    timeout_s: float
    baseline_s: float
    duration_s: float


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, StreamStalled):
        return "stalled"
    code = getattr(exc, "code", None)
    return code().name if callable(code) else type(exc).__name__


def compare_pages(asked: list[bytes], got: list[tuple[bytes, Any]],
                  expected: Callable[[bytes], bytes]) -> tuple[int, int]:
    """Compare each (key, blob) a Get returned, in order, with `expected(key)`. Returns how many
    leading pages of `asked` arrived whole and in order (what an engine could load), and how
    many blobs were wrong: not byte-exact, of a key not asked for, or out of order."""
    position = {k: i for i, k in enumerate(asked)}
    hit, last, wrong = 0, -1, 0
    for key, blob in got:
        i = position.get(key, -1)
        if i <= last or blob != expected(key):
            wrong += 1
            continue
        hit, last = (hit + 1 if i == hit else hit), i
    return hit, wrong


class TrafficClient:
    def __init__(self, args: ClientArgs, progress: Any) -> None:
        self.args, self.progress = args, progress  # progress: a shared array, 4 slots per client
        self.client = StoreClient(args.address, timeout_s=args.timeout_s)
        self.payloads = PagePayloads(args.workload)
        self.fingerprint = bytes.fromhex(args.workload.spec.fingerprint)
        self.conversations = Conversations(args.workload, args.index, args.workload.prompt_keys())
        self.probe = bytes(32)  # the baseline's key: a Lookup of 1 key the store does not hold
        self.client.lookup([self.probe])  # warm-up, untimed: channel up, first-call costs paid

    def _mark(self, phase: int, started: float) -> None:
        slot = 4 * self.args.index
        self.progress[slot], self.progress[slot + 1] = phase, started

    def run_baseline(self, report: ClientReport) -> None:
        started = time.monotonic()
        self._mark(1, started)
        while (begin := time.monotonic()) < started + self.args.baseline_s:
            try:
                self.client.lookup([self.probe])
                report.baseline.add(begin)
            except Exception as exc:
                report.errors[f"baseline {error_kind(exc)}"] += 1
        report.baseline_window = (started, time.monotonic())

    def run_mix(self, report: ClientReport) -> None:
        started = time.monotonic()
        self._mark(2, started)
        slot = 4 * self.args.index
        while time.monotonic() < started + self.args.duration_s:
            try:
                self._request(report)
            except Exception as exc:  # the request ends at its first failed call
                report.errors[error_kind(exc)] += 1
            report.requests += 1
            self.progress[slot + 2], self.progress[slot + 3] = report.requests, sum(report.errors.values())
        report.window = (started, time.monotonic())
        report.new_pages = self.conversations.new_pages

    def _request(self, report: ClientReport) -> None:
        request = self.conversations.next_request()
        keys, timeout = request.keys, self.args.timeout_s
        begin = time.monotonic()
        leading = self.client.lookup(keys, timeout_s=timeout).leading
        report.ops["lookup"].add(begin)
        hit = 0
        if leading:
            begin = time.monotonic()
            got = [(item.key, item.blob) for item in self.client.get(keys[:leading], self.fingerprint, timeout)]
            report.ops["get"].add(begin)
            hit, wrong = compare_pages(keys[:leading], got, self.payloads.blob)
            report.pages_compared += len(got)
            report.pages_missing += leading - len(got)
            if wrong:
                report.errors["wrong_bytes"] += wrong
        items = [(k, self.payloads.blob(k)) for k in keys[hit:]]
        begin = time.monotonic()
        reply = self.client.put(items, self.fingerprint, timeout)
        report.ops["put"].add(begin)
        report.pages_put += len(items)
        for refusal in reply.refused:
            report.errors[f"put refused ({pb.RefusalReason.Name(refusal.reason)})"] += 1

    def close(self) -> None:
        self.client.close()


def run_client(index: int, barrier: Any, results: Any, args: ClientArgs, progress: Any,
               start_timeout_s: float) -> None:
    """A client process: warm up, then the baseline and the mix, each released with the others by
    `barrier`; puts `(index, ClientReport)` on `results`, or `(index, "error text")`."""
    try:
        from tiered_cache.device.malloc import tune_malloc

        tune_malloc()  # as the tiered-cache commands do
        client = TrafficClient(args, progress)
        report = ClientReport(Timeline(), (0.0, 0.0), {op: Timeline() for op in OPS}, (0.0, 0.0), Counter())
        barrier.wait(start_timeout_s)
        client.run_baseline(report)
        barrier.wait(start_timeout_s)
        client.run_mix(report)
        results.put((index, report))
        client.close()
    except BaseException as exc:  # reported to the parent, which raises
        barrier.abort()
        results.put((index, f"{type(exc).__name__}: {exc}"))
