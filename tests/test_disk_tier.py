import os
import signal
import subprocess
import sys
import time

import pytest
from tier_helpers import SPEC, blobs_for, keys_for

from tiered_cache.tiers.codec import decode_page
from tiered_cache.tiers.disk import DiskTier


def test_round_trip_reopen_and_lru(tmp_path):
    items = blobs_for(6)
    size = len(items[0][1])
    evicted = []
    disk = DiskTier(tmp_path, 4 * size, on_evict=evicted.extend)
    assert disk.put(items[:4]) == 4
    assert disk.get([items[0][0]]) == [items[0][1]]  # 0 is now the most recent
    disk.put(items[4:])
    assert [k for k, _ in evicted] == [items[1][0], items[2][0]]
    assert [b for _, b in evicted] == [items[1][1], items[2][1]]
    assert disk.contains_prefix([k for k, _ in items]) == 1
    reopened = DiskTier(tmp_path, 4 * size)
    assert sorted(reopened.index) == sorted([items[i][0] for i in (0, 3, 4, 5)])
    assert reopened.get([items[5][0]]) == [items[5][1]]
    assert reopened.stats().used_bytes == 4 * size


def test_corrupt_truncated_and_misplaced_files_are_misses_and_deleted(tmp_path):
    items = blobs_for(4)
    disk = DiskTier(tmp_path, "1MiB")
    disk.put(items)
    paths = [disk._path(k) for k, _ in items]
    data = bytearray(paths[0].read_bytes())
    data[200] ^= 0xFF
    paths[0].write_bytes(bytes(data))  # bit flip
    paths[1].write_bytes(paths[1].read_bytes()[:-7])  # truncated
    paths[2].write_bytes(items[3][1])  # another page's blob under this key
    got = disk.get([k for k, _ in items])
    assert got == [None, None, None, items[3][1]]
    assert disk.stats().corrupt == 3 and not any(p.exists() for p in paths[:3])
    assert disk.contains_prefix([k for k, _ in items]) == 0


def test_leftover_temporaries_are_removed_at_start(tmp_path):
    disk = DiskTier(tmp_path, "1MiB")
    disk.put(blobs_for(1))
    stray = disk._path(keys_for(1)[0]).parent / ".abc.123.deadbeef.tmp"
    stray.write_bytes(b"half a blob")
    DiskTier(tmp_path, "1MiB")
    assert not stray.exists()


WRITER = """
import sys
from tier_helpers import blobs_for
from tiered_cache.tiers.disk import DiskTier
disk = DiskTier(sys.argv[1], "1GiB")
print("ready", flush=True)
for start in range(0, 100000, 8):
    disk.put(blobs_for(8, seed=start, start=start * 4))
"""


def test_sigkill_during_writes_leaves_only_intact_blobs(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            cwd=os.path.dirname(__file__), env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(1.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    disk = DiskTier(tmp_path, "1GiB")
    keys = list(disk.index)
    assert len(keys) > 16, "the writer should have written some pages before it was killed"
    blobs = disk.get(keys)
    assert disk.stats().corrupt == 0 and all(b is not None for b in blobs)
    for key, blob in zip(keys, blobs, strict=True):
        decode_page(blob, SPEC, key)  # raises if anything is off
    assert not list(tmp_path.rglob("*.tmp"))


def test_blob_larger_than_capacity_is_refused(tmp_path):
    items = blobs_for(1)
    disk = DiskTier(tmp_path, 10)
    assert disk.put(items) == 0 and disk.contains_prefix([items[0][0]]) == 0
    with pytest.raises(ValueError, match="cannot read size"):
        DiskTier(tmp_path, "much")
