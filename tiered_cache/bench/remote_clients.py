"""Client processes for `tiered-cache bench remote --clients`: each one a separate Python process
(spawned: nothing shared but what is passed), set up and warmed, then all released together by one
barrier so that start-up is not timed; each runs until the same deadline and reports back.

- `GetClient`: `RemoteTier.get` of a prefix again and again (default settings); every page is
  checked byte for byte against what was put, read from one file that every client maps.
- `RawStreamClient`: the bare gRPC stream of the same bytes from `raw_grpc.py`, messages kept.
- `LookupClient`: a `Lookup` of a prompt every few milliseconds, each latency recorded.

This module imports no torch: a client process stays small and starts fast.
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from tiered_cache.bench.released_clients import run_released

_RAW_MAX_MESSAGE = 80 * 2**20  # raw_grpc.py's message limit
_START_TIMEOUT_S = 300.0  # spawning, importing and one warm-up call, 17 processes on few cores
_END_SLACK_S = 300.0  # the last call of a round may run past the deadline by this much at most


def raw_channel(address: str) -> grpc.Channel:
    """A channel to `raw_grpc.py`, with the store client's HTTP/2 options."""
    from tiered_cache.wire.options import channel_options

    return grpc.insecure_channel(address, options=channel_options(_RAW_MAX_MESSAGE))


def raw_stream_request(count: int, size: int) -> bytes:
    """`raw_grpc.py`'s Stream request: send `count` messages of `size` bytes."""
    return struct.pack("<QQ", count, size)


def verify_pages(blobs: Sequence[bytes | None], expected: Sequence[bytes], who: str) -> int:
    """Bytes received. Raises RuntimeError when a page is missing or not byte-exact against what
    was put: a figure from wrong data is worthless."""
    if len(blobs) != len(expected):
        raise RuntimeError(f"{who}: asked for {len(expected):,} pages, got {len(blobs):,} answers")
    missing = [i for i, blob in enumerate(blobs) if blob is None]
    if missing:
        raise RuntimeError(f"{who}: {len(missing):,} of {len(blobs):,} pages missing (first: page {missing[0]})")
    for i, blob in enumerate(blobs):
        if blob != expected[i]:
            raise RuntimeError(f"{who}: page {i} differs from the blob that was put "
                               f"({len(blob or b''):,} bytes received, {len(expected[i]):,} put)")
    return sum(len(blob or b"") for blob in blobs)


class MappedBlobs(Sequence[bytes]):
    """The blobs that were put, concatenated in one file: `blobs[i]` reads page i from a mapping
    (the page cache holds one copy for every client)."""

    def __init__(self, path: Path, sizes: Sequence[int]) -> None:
        self.path, self.sizes = path, list(sizes)
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)
        self._map: mmap.mmap | None = None

    @classmethod
    def write(cls, path: Path, blobs: Sequence[bytes]) -> MappedBlobs:
        with path.open("wb") as f:
            for blob in blobs:
                f.write(blob)
        return cls(path, [len(b) for b in blobs])

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: Any) -> Any:
        if self._map is None:
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map[self.offsets[i]:self.offsets[i + 1]]  # a copy, then one memcmp

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}


class Client(Protocol):
    gap_s: float  # idle time after each call

    def step(self) -> int:
        """One call; returns the bytes it received."""

    def close(self) -> None: ...


class GetClient:
    gap_s = 0.0

    def __init__(self, address: str, keys: list[bytes], expected: MappedBlobs, name: str) -> None:
        from tiered_cache.tiers.remote import RemoteTier

        self.tier = RemoteTier([address])  # default settings: 5 s progress deadline, no budget
        self.keys, self.expected, self.name = keys, expected, name

    def step(self) -> int:
        return verify_pages(self.tier.get(self.keys), self.expected, self.name)

    def close(self) -> None:
        self.tier.close()


class RawStreamClient:
    gap_s = 0.0

    def __init__(self, address: str, count: int, size: int, name: str) -> None:
        self.channel = raw_channel(address)
        self.stream = self.channel.unary_stream("/raw.Raw/Stream")
        self.request, self.count, self.size, self.name = raw_stream_request(count, size), count, size, name

    def step(self) -> int:
        kept = list(self.stream(self.request, timeout=_END_SLACK_S))  # kept, as a get must
        if len(kept) != self.count or any(len(m) != self.size for m in kept):
            raise RuntimeError(f"{self.name}: expected {self.count} messages of {self.size:,} bytes")
        return self.count * self.size

    def close(self) -> None:
        self.channel.close()


class LookupClient:
    gap_s = 0.005  # a scheduler asking per arriving request, not a lookup flood competing for the CPU

    def __init__(self, address: str, keys: list[bytes], name: str) -> None:
        from tiered_cache.tiers.remote import RemoteTier

        self.tier = RemoteTier([address])
        self.keys, self.name = keys, name

    def step(self) -> int:
        found = self.tier.contains_prefix(self.keys)
        if found != len(self.keys):
            raise RuntimeError(f"{self.name}: the store holds {found:,} of the prompt's {len(self.keys):,} pages")
        return 0

    def close(self) -> None:
        self.tier.close()


@dataclass(frozen=True)
class Report:
    """One client's round: released at `started`, last call ended at `ended` (time.monotonic, one
    clock for every process on the host)."""

    started: float
    ended: float
    nbytes: int
    latencies: tuple[float, ...]  # seconds, one per call


Job = tuple[type, tuple[Any, ...]]  # a client class and its arguments


def _run_client(index: int, barrier: Any, results: Any, job: Job, duration_s: float) -> None:
    try:
        from tiered_cache.device.malloc import tune_malloc

        tune_malloc()  # as the tiered-cache commands and TieredCache do
        client: Client = job[0](*job[1])
        client.step()  # warm-up, untimed: channel up, first-call costs paid
        barrier.wait(_START_TIMEOUT_S)
        started = time.monotonic()
        deadline, nbytes, latencies = started + duration_s, 0, []
        while (begin := time.monotonic()) < deadline:
            nbytes += client.step()
            latencies.append(time.monotonic() - begin)
            time.sleep(client.gap_s)
        results.put((index, Report(started, time.monotonic(), nbytes, tuple(latencies))))
        client.close()
    except BaseException as exc:  # reported to the parent, which raises
        barrier.abort()
        results.put((index, f"{type(exc).__name__}: {exc}"))


def run_together(jobs: list[Job], duration_s: float) -> list[Report]:
    """Start one process per job, release them together once all are warm, and return their
    reports in job order (see `run_released` for how a failure is raised)."""
    assert jobs and duration_s > 0
    return run_released(_run_client, [(job, duration_s) for job in jobs], _START_TIMEOUT_S + duration_s + _END_SLACK_S,
                        names=[job[0].__name__ for job in jobs])
