"""The one-pass copy + CRC-32C (tiered_cache/wire/checked_copy.py, its native part
_checked_copy.c): the same bytes and the same CRC as a plain copy and the crc32c package, for
every length, alignment, stride and starting CRC; and a raw blob decoded through it into a pool
page's strided blocks is refused when any byte of it is wrong."""

from __future__ import annotations

import mmap
import os
import platform
import shutil
import sysconfig

import numpy as np
import pytest

from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.wire import checked_copy
from tiered_cache.wire.checked_copy import copy_crc, copy_crc_two_pass
from tiered_cache.wire.checksum import crc32c_extend
from tiered_cache.wire.codec import BlobError, decode_into, encode_page

WAYS = [pytest.param(copy_crc, id="copy_crc"), pytest.param(copy_crc_two_pass, id="two_pass")]


def test_the_native_copy_is_built_where_it_can_be():
    """`make install` builds it on x86-64 with a C compiler: a broken build must not hide behind
    the fallback."""
    include = sysconfig.get_paths()["include"]
    if (platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("cc") is None
            or not os.path.isfile(os.path.join(include, "Python.h"))):
        pytest.skip("not x86-64, or no C compiler or Python headers: the two-pass copy is the one used")
    assert checked_copy._native is not None, "the native copy did not build: pip install -e . shows why"


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("inner", [1, 7, 8, 23, 24, 25, 47, 48, 100, 4097, 32768])
@pytest.mark.parametrize("outer", [(), (3,), (4,), (2, 3), (2, 5)])
def test_same_bytes_and_crc_as_a_copy_and_the_crc32c_package(way, inner, outer):
    rng = np.random.default_rng(inner * 7 + len(outer))
    src = rng.integers(0, 256, int(np.prod(outer, dtype=np.int64)) * inner, dtype=np.uint8)
    # A destination of strided runs, each run's start shifted off 8-byte alignment for some shapes.
    pad = 5 if inner % 2 else 8
    room = np.zeros((*outer[::-1], inner + pad), dtype=np.uint8)
    dest = room[..., pad:pad + inner] if inner % 2 else room[..., :inner]
    dest = dest.transpose(*reversed(range(len(outer))), len(outer)) if outer else dest
    start = int(rng.integers(0, 2**32))
    assert way(src, dest, start) == crc32c_extend(start, src.tobytes())
    assert np.array_equal(np.ascontiguousarray(dest).reshape(-1), src)
    dest[...] = 0
    assert not room.any()  # nothing written outside the runs


@pytest.mark.parametrize("way", WAYS)
def test_a_read_only_mapping_is_a_source(way, tmp_path):
    data = np.random.default_rng(1).integers(0, 256, 3 * 40000, dtype=np.uint8)
    path = tmp_path / "pages"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        dest = np.zeros((3, 40000), dtype=np.uint8)
        view = memoryview(mapped)
        try:
            assert way(view, dest) == crc32c_extend(0, data.tobytes())
        finally:
            view.release()
    assert np.array_equal(dest.reshape(-1), data)


@pytest.mark.parametrize("way", WAYS)
def test_sizes_that_differ_are_refused(way):
    with pytest.raises(ValueError, match="destination holds 10 bytes, source 11"):
        way(bytes(11), np.zeros(10, dtype=np.uint8))


@pytest.mark.skipif(checked_copy._native is None, reason="the native copy is not built here")
def test_the_native_copy_refuses_what_it_cannot_write():
    from tiered_cache.wire import _checked_copy

    with pytest.raises(ValueError, match="at most 3 dimensions"):
        _checked_copy.copy_crc(bytes(16), np.zeros((2, 2, 2, 2), dtype=np.uint8), 0)
    with pytest.raises(ValueError, match="last contiguous"):
        _checked_copy.copy_crc(bytes(8), np.zeros((4, 4), dtype=np.uint8)[:, ::2], 0)
    with pytest.raises(BufferError):
        _checked_copy.copy_crc(bytes(4), b"abcd", 0)  # read-only destination
    # What copy_crc cannot hand to the native part goes the two-pass way, with the same result.
    wide = np.zeros((4, 4), dtype=np.uint8)[:, ::2]
    assert copy_crc(bytes(range(8)), wide) == crc32c_extend(0, bytes(range(8)))
    assert np.array_equal(wide.reshape(-1), np.arange(8, dtype=np.uint8))


def _pool_page(spec: KVSpec) -> tuple[np.ndarray, np.ndarray]:
    """A layer-first CPU pool of 3 pages and page 1's blocks as a destination (page-first order)."""
    per = spec.bytes_per_page // (2 * spec.num_layers)
    pool = np.zeros((2, spec.num_layers, 3, per), dtype=np.uint8)
    return pool, pool[:, :, 1].transpose(1, 0, 2)


def test_a_raw_blob_lands_in_a_pool_page_and_any_wrong_byte_is_refused():
    spec = KVSpec(model_id="m", num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=DType.FP16)
    rng = np.random.default_rng(3)
    page = rng.standard_normal(spec.staging_shape(1)[1:]).astype(np.float16)
    key = os.urandom(32)
    blob = encode_page(page, spec, key)
    pool, dest = _pool_page(spec)
    decode_into(blob, spec, key, dest)
    assert np.array_equal(dest.reshape(-1), page.view(np.uint8).reshape(-1))
    assert not pool[:, :, [0, 2]].any()  # the other pages untouched
    for at in (0, 150, len(blob) // 2, len(blob) - 5, len(blob) - 1):  # header, payload, trailer
        bad = bytearray(blob)
        bad[at] ^= 0x10
        with pytest.raises(BlobError):
            decode_into(bytes(bad), spec, key, _pool_page(spec)[1])
