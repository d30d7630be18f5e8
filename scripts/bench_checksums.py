"""Checksum throughput on one thread, best of 7 runs, random bytes (docs/PERFORMANCE.md, "Checksums").

Needs the candidates that are not project dependencies:
    .venv/bin/pip install crc32c xxhash && .venv/bin/python scripts/bench_checksums.py
"""
import os
import sys
import time
import zlib

import crc32c
import google_crc32c
import numpy as np
import xxhash

assert google_crc32c.implementation == "c", google_crc32c.implementation
assert crc32c.hardware_based
SIZES = {"1 MiB": 1 << 20, "360 KiB": 360 << 10}
REPEATS, INNER = 7, 200


def best_gibs(fn, buf):
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(INNER):
            fn(buf)
        best = min(best, (time.perf_counter() - t0) / INNER)
    return len(buf) / best / 2**30


CANDIDATES = [
    ("zlib.crc32 (CRC-32)", lambda b: zlib.crc32(b), "bytes"),
    ("google_crc32c.value (CRC32C)", lambda b: google_crc32c.value(b), "bytes"),
    ("google_crc32c.extend, numpy view (CRC32C)", lambda b: google_crc32c.extend(0, b), "numpy"),
    ("crc32c.crc32c (CRC32C)", lambda b: crc32c.crc32c(b), "bytes"),
    ("crc32c.crc32c, memoryview slice (CRC32C)", lambda b: crc32c.crc32c(b), "memoryview"),
    ("xxhash.xxh3_64 (64-bit hash)", lambda b: xxhash.xxh3_64_intdigest(b), "bytes"),
    ("xxhash.xxh64 (64-bit hash)", lambda b: xxhash.xxh64_intdigest(b), "bytes"),
]


def as_kind(data: bytes, kind: str):
    if kind == "numpy":
        return np.frombuffer(data, np.uint8, count=len(data) - 4)  # what read_header checks: all but the trailer
    if kind == "memoryview":
        return memoryview(data)[:len(data) - 4]
    return data


def main() -> None:
    print(f"python {sys.version.split()[0]}, cpus {os.cpu_count()}, google-crc32c impl "
          f"{google_crc32c.implementation}, crc32c hardware_based {crc32c.hardware_based}, "
          f"xxhash {xxhash.VERSION}")
    data = {name: os.urandom(n) for name, n in SIZES.items()}
    print(f"{'function':45s}" + "".join(f"{n + ' GiB/s':>16s}" for n in SIZES))
    for label, fn, kind in CANDIDATES:
        row = [best_gibs(fn, as_kind(d, kind)) for d in data.values()]
        print(f"{label:45s}" + "".join(f"{v:16.1f}" for v in row))


if __name__ == "__main__":
    main()
