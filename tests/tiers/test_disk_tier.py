import errno
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from tier_helpers import SPEC, blobs_for, keys_for

from tiered_cache.errors import TieredCacheError
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.tiers.disk_lock import LOCK_NAME, FolderInUseError
from tiered_cache.wire.codec import decode_page, verify_blob

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the helpers


def python(script: str, *args: object) -> subprocess.Popen:
    """`script` in another interpreter that imports the test helpers, talking over pipes."""
    path = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))  # keep the caller's too
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=TESTS, env={**os.environ, "PYTHONPATH": path})


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
    disk.close()
    reopened = DiskTier(tmp_path, 4 * size)
    assert sorted(reopened.index) == sorted([items[i][0] for i in (0, 3, 4, 5)])
    assert reopened.get([items[5][0]]) == [items[5][1]]
    assert reopened.stats().used_bytes == 4 * size


def test_corrupt_truncated_and_misplaced_files_are_misses_and_deleted(tmp_path):
    items = blobs_for(4)
    disk = DiskTier(tmp_path, "1MiB")
    disk.put(items)
    paths = [disk.file_of(k) for k, _ in items]
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
    stray = disk.file_of(keys_for(1)[0]).parent / ".abc.123.deadbeef.tmp"
    stray.write_bytes(b"half a blob")
    disk.close()
    DiskTier(tmp_path, "1MiB").close()
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
    proc = python(WRITER, tmp_path)
    assert proc.stdout.readline().strip() == b"ready"
    # Killed while it writes, once it has written more than the 16 pages asserted below (a fixed
    # 1.5 s sleep waited the same way, at a guess).
    deadline = time.monotonic() + 30
    while sum(1 for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")) <= 32:
        assert time.monotonic() < deadline and proc.poll() is None, "the writer wrote nothing"
        time.sleep(0.02)
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


def test_reopened_folder_serves_intact_files_and_drops_damaged_ones(tmp_path):
    items = blobs_for(6)
    keys, blobs = [k for k, _ in items], [b for _, b in items]
    DiskTier(tmp_path, "1MiB").put(items)
    paths = [tmp_path / k.hex() for k in keys]
    paths[0].write_bytes(paths[0].read_bytes()[:-100])  # truncated
    flipped = bytearray(paths[1].read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    paths[1].write_bytes(bytes(flipped))  # one bit of the payload rotted
    paths[2].write_bytes(b"")  # renamed, but its bytes never reached the disk (no fsync)
    v1 = bytearray(blobs[3])
    v1[4] = 1  # the same page written by a build of blob format version 1
    (tmp_path / ("ab" * 32)).write_bytes(bytes(v1))
    disk = DiskTier(tmp_path, "1MiB")
    # At start each file's header is read: a length that disagrees with it (truncated, empty) or
    # another blob format is dropped then. Reading every byte of a full disk there would stall the
    # start, so a flipped byte is caught by the checksum of the first read: a miss, counted and
    # deleted, never served.
    assert disk.contains(keys) == [False, True, False, True, True, True]
    assert disk.stats().corrupt == 3 and not paths[0].exists() and not paths[2].exists()
    assert not (tmp_path / ("ab" * 32)).exists()
    assert disk.get(keys) == [None, None, None, *blobs[3:]]
    assert disk.stats().corrupt == 4 and disk.contains(keys) == [False] * 3 + [True] * 3
    assert not any(p.exists() for p in paths[:3]) and (tmp_path / LOCK_NAME).exists()
    disk.close()
    again = DiskTier(tmp_path, "1MiB")
    assert sorted(again.index) == sorted(keys[3:]) and again.get(keys[3:]) == blobs[3:]
    again.close()


# --- one owner per folder -----------------------------------------------------------------------------


def test_a_second_tier_on_the_folder_in_this_process_is_refused_and_deletes_nothing(tmp_path):
    items = blobs_for(4)
    keys, blobs = [k for k, _ in items], [b for _, b in items]
    first = DiskTier(tmp_path, "1MiB")
    first.put(items)
    in_flight = tmp_path / ".abc.123.deadbeef.tmp"  # the owner's write under way
    in_flight.write_bytes(b"half a blob")
    with pytest.raises(FolderInUseError) as refused:
        DiskTier(tmp_path, 1)  # had it opened, it would have dropped the temporary and evicted everything
    assert isinstance(refused.value, TieredCacheError) and refused.value.pid == os.getpid()
    assert f"disk folder {tmp_path} is in use: pid {os.getpid()} (this process" in str(refused.value)
    assert in_flight.exists() and first.get(keys) == blobs and first.stats().evictions == 0
    first.close()
    first.close()  # idempotent
    second = DiskTier(tmp_path, "1MiB")
    assert second.get(keys) == blobs and not in_flight.exists()
    assert (tmp_path / LOCK_NAME).read_text().startswith(f"pid {os.getpid()}\nhost {socket.gethostname()}\n")
    second.close()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # names live holders only
    DiskTier(tmp_path, "1MiB")  # dropped without close(): collected, it lets go all the same
    DiskTier(tmp_path, "1MiB").close()


HOLDER = """
import sys
from tier_helpers import blobs_for
from tiered_cache.tiers.disk import DiskTier
disk = DiskTier(sys.argv[1], "1MiB")
disk.put(blobs_for(4, seed=9))
print("ready", flush=True)
sys.stdin.readline()
disk.close()
print("closed", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("let_go", ["close", "sigkill"])
def test_a_folder_another_process_holds_is_refused_until_it_lets_go(tmp_path, let_go):
    items = blobs_for(4, seed=9)
    holder = python(HOLDER, tmp_path)
    try:
        assert holder.stdout.readline().strip() == b"ready"
        with pytest.raises(FolderInUseError) as refused:
            DiskTier(tmp_path, "1MiB")
        assert refused.value.pid == holder.pid and refused.value.folder == tmp_path
        assert f"is in use: pid {holder.pid} on host {socket.gethostname()} holds" in str(refused.value)
        if let_go == "close":
            holder.stdin.write(b"\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == b"closed"
            assert holder.poll() is None  # still running: close() alone gave the folder up
        else:
            holder.kill()
            holder.wait()
        disk = DiskTier(tmp_path, "1MiB")
        assert disk.get([k for k, _ in items]) == [b for _, b in items]
        disk.close()
    finally:
        holder.kill()
        holder.wait()


def test_a_second_store_server_on_a_held_folder_exits_saying_who_holds_it(tmp_path):
    with StoreProcess(["--disk", str(tmp_path)]) as first:
        second = subprocess.run([sys.executable, "-m", "tiered_cache.cli.main", "serve", "--port", "0", "--disk",
                                 str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and "listening" not in second.stdout
        assert second.stderr.startswith(f"tiered-cache serve: error: disk folder {tmp_path} is in use: "
                                         f"pid {first.proc.pid} on host {socket.gethostname()} holds its lock ")


# --- a full filesystem ------------------------------------------------------------------------------


def fill(path) -> None:
    """Write zeros into `path` until the filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_full_filesystem_evicts_the_oldest_pages_and_keeps_admitting_new_ones(small_fs):
    # 3,000 pages of ~1.1 KiB, each taking a 4 KiB block: about three times the filesystem (1,024
    # blocks), and far below the tier's capacity, so only the full filesystem can make room.
    items = blobs_for(3000)
    keys, blobs = [k for k, _ in items], [b for _, b in items]
    disk = DiskTier(small_fs / "disk", "1GiB")
    stored = [disk.put(items[i:i + 8]) for i in range(0, len(items), 8)]
    assert stored == [8] * len(stored)  # every batch admitted in full
    stats = disk.stats()
    assert stats.errors == 0 and 900 < stats.pages < 1024 and stats.evictions == len(items) - stats.pages
    got = disk.get(keys)
    assert all(g is None or g == b for g, b in zip(got, blobs, strict=True))
    held = [i for i, g in enumerate(got) if g is not None]
    assert held == list(range(len(items) - stats.pages, len(items)))  # the newest run, nothing older
    assert disk.stats().corrupt == 0
    # No partial file: the folder holds the lock and one whole blob per page held.
    names = sorted(p.name for p in (small_fs / "disk").iterdir())
    assert names == sorted([LOCK_NAME, *(keys[i].hex() for i in held)])
    disk.close()


def test_room_taken_by_someone_else_is_made_from_the_oldest_pages_or_the_write_dropped(small_fs):
    old, new = blobs_for(8), blobs_for(8, seed=1, start=100)
    disk = DiskTier(small_fs / "disk", "1GiB")
    fill(small_fs / "someone-else")
    assert disk.put(old) == 0  # nothing of its own to evict: each write fails, none raises
    assert disk.stats().errors == 8 and disk.stats().pages == 0
    assert os.listdir(small_fs / "disk") == [LOCK_NAME]  # no partial file left behind
    (small_fs / "someone-else").unlink()
    assert disk.put(old) == 8
    fill(small_fs / "someone-else")
    assert disk.put(new) == 8  # the old pages made room
    assert disk.get([k for k, _ in old]) == [None] * 8
    assert disk.get([k for k, _ in new]) == [b for _, b in new]
    assert disk.stats().errors == 8 and disk.stats().evictions == 8
    for path in (small_fs / "disk").iterdir():
        if path.name != LOCK_NAME:
            verify_blob(path.read_bytes(), bytes.fromhex(path.name))
    disk.close()


def test_a_filesystem_smaller_than_the_capacity_is_said_at_start_and_bounds_the_tier(small_fs, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="tiered_cache"):
        disk = DiskTier(small_fs / "disk", "1GiB")
    try:
        assert disk.capacity <= 4 * 2**20 and disk.stats().capacity_bytes == disk.capacity  # the real bound
        assert any("less than its capacity of 1 GiB" in r.getMessage() for r in caplog.records)
    finally:
        disk.close()
