import mmap
import struct
import zlib

import google_crc32c
import numpy as np
import pytest
import torch

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import DType, KVSpec, Layout
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.wire import checksum
from tiered_cache.wire import codec as codec_module
from tiered_cache.wire.codec import (
    VERSION,
    BlobError,
    Codec,
    blob_checksum,
    decode_page,
    encode_page,
    read_header,
    verify_blob,
)

SPEC = KVSpec("m", 3, 2, 16, page_size=4)


def page_of(spec, seed=0, smooth=False):
    gen = torch.Generator().manual_seed(seed)
    shape = spec.staging_shape(1)[1:]
    if smooth:  # compressible: repeated rows
        return torch.randn((*shape[:-1], 1), generator=gen).expand(shape).contiguous().to(spec.dtype.torch)
    return torch.randn(shape, generator=gen).to(spec.dtype.torch)


def key_of(spec, n=0):
    return PageKeyer(spec).keys(list(range(n, n + spec.page_size)))[0]


def as_tensor(raw, spec):
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.uint8).view(spec.dtype.torch).reshape(
        spec.staging_shape(1)[1:])


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.LZ4, Codec.LZ4_SHUFFLE, Codec.BLOSC2])
@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16, DType.FP32])
@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("smooth", [False, True])
def test_lossless_round_trip(codec, dtype, layout, smooth):
    spec = SPEC.with_options(dtype=dtype, layout=layout)
    page, key = page_of(spec, smooth=smooth), key_of(spec)
    blob = encode_page(page, spec, key, codec)
    assert torch.equal(as_tensor(decode_page(blob, spec, key), spec), page)
    header = read_header(blob)
    assert header.key == key and header.raw_len == spec.bytes_per_page
    if smooth and codec is not Codec.RAW:
        # Bitshuffle spreads a row repeated every 32 bytes over bit planes: less to gain on this toy page.
        assert header.codec is codec and len(blob) < spec.bytes_per_page / (1.5 if codec is Codec.BLOSC2 else 2)
    if not smooth and codec is Codec.LZ4:
        assert header.codec is Codec.RAW  # random fp data does not compress: stored raw


def test_min_saving_margin_decides_raw_fallback():
    spec = SPEC.with_options(dtype=DType.BF16)
    page, key = page_of(spec), key_of(spec)
    # bf16 byte planes compress a little (exponents); a 90% margin refuses that, a 0% one takes it.
    assert read_header(encode_page(page, spec, key, "lz4-shuffle", min_saving=0.9)).codec is Codec.RAW
    assert read_header(encode_page(page, spec, key, "lz4-shuffle", min_saving=0.0)).codec is Codec.LZ4_SHUFFLE


@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16, DType.FP32])
def test_int8_is_about_half_size_and_within_its_stated_error(dtype):
    spec = KVSpec("m", 4, 2, 64, dtype=dtype, page_size=16)
    page, key = page_of(spec, seed=3), key_of(spec)
    blob = encode_page(page, spec, key, Codec.INT8)
    assert read_header(blob).codec is Codec.INT8
    if dtype is not DType.FP32:
        assert spec.bytes_per_page / len(blob) > 1.85
    back = as_tensor(decode_page(blob, spec, key), spec).float()
    ref = page.float()
    # Per row (token, head): error at most half a quantisation step of absmax/127 (+ output rounding).
    step = ref.abs().amax(dim=-1, keepdim=True) / 127
    assert ((back - ref).abs() <= step * 0.5 + ref.abs() * 2**-7 + 1e-6).all()
    rel = (back - ref).norm() / ref.norm()
    assert 1e-4 < rel < 2e-2


def test_int8_handles_all_zero_rows():
    spec = KVSpec("m", 1, 1, 8, page_size=2)
    page = torch.zeros(spec.staging_shape(1)[1:], dtype=torch.float16)
    page[0, 0, 0, 0, 3] = 1.5
    blob = encode_page(page, spec, key_of(spec), Codec.INT8)
    back = as_tensor(decode_page(blob, spec, key_of(spec)), spec)
    assert torch.isfinite(back).all() and back[0, 0, 0, 0, 3] == 1.5 and back.count_nonzero() == 1


def test_every_kind_of_bad_blob_is_refused():
    spec = SPEC
    key = key_of(spec)
    blob = encode_page(page_of(spec), spec, key, Codec.RAW)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x01
    cases = {
        "truncated": blob[:-100],
        "too short": blob[:10],
        "checksum": bytes(flipped),
        "magic": b"XXXX" + blob[4:],
        "version": blob[:4] + b"\x09" + blob[5:],
    }
    for name, bad in cases.items():
        with pytest.raises(BlobError):
            decode_page(bad, spec, key)
        assert name
    with pytest.raises(BlobError, match="asked for"):
        verify_blob(blob, key_of(spec, 100))
    with pytest.raises(BlobError, match="fingerprint"):
        decode_page(blob, spec.with_options(model_id="other"), key)
    with pytest.raises(BlobError, match="checksum"):
        decode_page(bytes(flipped), spec, key)


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="a page of m is"):
        encode_page(np.zeros(10, np.uint8), SPEC, key_of(SPEC))
    with pytest.raises(ValueError, match="page key must be 32 bytes"):
        encode_page(page_of(SPEC), SPEC, b"k")
    with pytest.raises(ValueError, match="unknown codec 'zstd'"):
        encode_page(page_of(SPEC), SPEC, key_of(SPEC), "zstd")
    fp8 = SPEC.with_options(dtype=DType.FP8_E4M3)
    with pytest.raises(ValueError, match="int8 codec needs"):
        encode_page(np.zeros(fp8.bytes_per_page, np.uint8), fp8, key_of(fp8), Codec.INT8)


def test_decode_into_a_preallocated_buffer():
    page, key = page_of(SPEC), key_of(SPEC)
    out = np.full(SPEC.bytes_per_page, 0xAB, dtype=np.uint8)
    assert decode_page(encode_page(page, SPEC, key, "lz4-shuffle", min_saving=0), SPEC, key, out=out) is out
    assert torch.equal(as_tensor(out, SPEC), page)


def test_a_blosc2_chunk_that_does_not_match_the_header_is_refused_before_decoding():
    """The outer CRC is skipped for a blob a tier verified a moment ago: the chunk's own sizes are
    still checked, so a chunk that would write more than a page never reaches the buffer."""
    import blosc2

    from tiered_cache.wire.codec import _assemble

    key = key_of(SPEC)
    page = np.frombuffer(page_of(SPEC, smooth=True).numpy().tobytes(), np.uint8)
    too_long = blosc2.compress2(np.concatenate([page, page]), typesize=2)
    garbage = bytes(range(200)) * 4
    for payload, message in ((too_long, "holds .* bytes"), (garbage, "blosc2")):
        blob = _assemble(SPEC, key, Codec.BLOSC2, payload)
        out = np.full(SPEC.bytes_per_page + 64, 0xAB, np.uint8)
        with pytest.raises(BlobError, match=message):
            decode_page(blob, SPEC, key, out=out[:SPEC.bytes_per_page], check_crc=False)
        assert (out[SPEC.bytes_per_page:] == 0xAB).all()
    good = encode_page(page, SPEC, key, Codec.BLOSC2, min_saving=0)
    assert read_header(good).codec is Codec.BLOSC2
    assert np.array_equal(decode_page(good, SPEC, key), page)


def test_check_crc_false_skips_only_the_checksum():
    key = key_of(SPEC)
    blob = bytearray(encode_page(page_of(SPEC), SPEC, key))
    blob[-10] ^= 0x01  # payload bit flip: only the CRC can see it
    decode_page(bytes(blob), SPEC, key, check_crc=False)
    with pytest.raises(BlobError, match="checksum"):
        decode_page(bytes(blob), SPEC, key)
    with pytest.raises(BlobError, match="asked for"):  # key, fingerprint and lengths are still checked
        decode_page(bytes(blob), SPEC, key_of(SPEC, 50), check_crc=False)


def crc32c_bitwise(data: bytes) -> int:
    """CRC-32C by the book (reflected polynomial 0x82F63B78), independent of any library."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def test_checksum_is_crc32c_in_c_over_parts_without_joining():
    assert google_crc32c.implementation == "c"  # the pure-Python fallback is ~1000x slower
    assert crc32c_bitwise(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert blob_checksum(b"123456789") == 0xE3069283  # zlib's CRC-32 would be 0xCBF43926
    parts = (b"1234", memoryview(b"xx567xx")[2:5], bytearray(b"8"), np.frombuffer(b"9", np.uint8))
    assert blob_checksum(*parts) == 0xE3069283
    assert blob_checksum() == 0 == blob_checksum(b"")


def test_the_fast_crc32c_is_installed_by_make_and_both_implementations_agree_on_every_buffer():
    """`make` installs the `fast` extra; google-crc32c stays the fallback. Both must give the very
    same CRC on every kind of buffer a tier hands over (a blob written by one is read by the other)."""
    assert checksum.IMPLEMENTATION == "crc32c" and set(checksum.IMPLEMENTATIONS) == {"crc32c", "google-crc32c"}
    data = np.random.default_rng(3).integers(0, 256, 3 * 2**20 + 7, dtype=np.uint8).tobytes()
    ring = mmap.mmap(-1, len(data))  # what a lent page from the store's ring is a view of
    ring[:] = data
    forms = [data, bytearray(data), memoryview(data)[5:], np.frombuffer(data, np.uint8)[:-3], memoryview(ring)]
    try:
        for name, extend in checksum.IMPLEMENTATIONS.items():
            assert extend(0, b"123456789") == 0xE3069283, name
            assert extend(extend(0, b"1234"), memoryview(b"56789")) == 0xE3069283, name  # continued
            assert extend(0, memoryview(data)[:4096]) == crc32c_bitwise(data[:4096]), name
        for form in forms:
            values = {name: extend(0, form) for name, extend in checksum.IMPLEMENTATIONS.items()}
            assert len(set(values.values())) == 1, values
    finally:
        forms.pop().release()
        ring.close()


def test_blobs_round_trip_and_corruption_is_caught_with_the_google_fallback(monkeypatch):
    page, key = page_of(SPEC), key_of(SPEC)
    fast = encode_page(page, SPEC, key)
    monkeypatch.setattr(codec_module, "crc32c_extend", checksum.IMPLEMENTATIONS["google-crc32c"])
    slow = encode_page(page, SPEC, key)
    assert slow == fast  # the same bytes: a blob written with either is read with the other
    assert torch.equal(as_tensor(decode_page(memoryview(slow), SPEC, key), SPEC), page)
    bad = bytearray(slow)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(BlobError, match="checksum"):
        verify_blob(bytes(bad), key)


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.LZ4_SHUFFLE, Codec.INT8, Codec.BLOSC2])
def test_v2_blob_round_trips_with_a_crc32c_trailer_over_header_and_payload(codec):
    page, key = page_of(SPEC, smooth=True), key_of(SPEC)
    blob = encode_page(page, SPEC, key, codec, min_saving=0)
    assert VERSION == 2 and blob[:5] == b"TCKV\x02"
    assert struct.unpack("<I", blob[-4:])[0] == crc32c_bitwise(blob[:-4])
    assert read_header(blob).codec is codec
    for form in (blob, bytearray(blob), memoryview(blob)):  # tiers hand over any of these
        out = decode_page(form, SPEC, key)
        if not codec.lossy:
            assert torch.equal(as_tensor(out, SPEC), page)


def test_a_blob_of_a_mebibyte_or_more_checks_in_place():
    spec = KVSpec("big", 4, 8, 128, page_size=64)  # 1 MiB pages: bytes blobs this large release the GIL
    page, key = page_of(spec), key_of(spec)
    blob = encode_page(page, spec, key)
    assert len(blob) > 1 << 20
    assert torch.equal(as_tensor(decode_page(blob, spec, key), spec), page)
    flipped = bytearray(blob)
    flipped[len(blob) // 3] ^= 0x10
    with pytest.raises(BlobError, match="checksum"):
        decode_page(bytes(flipped), spec, key)


def test_a_flipped_bit_anywhere_is_refused():
    key = key_of(SPEC)
    blob = encode_page(page_of(SPEC), SPEC, key)
    for at in range(len(blob)):  # header, shape, payload and trailer alike
        bad = bytearray(blob)
        bad[at] ^= 0x01
        with pytest.raises(BlobError):
            decode_page(bytes(bad), SPEC, key)
    # Bytes that only the checksum covers: reserved header field, payload, trailer.
    for at in (76, 200, len(blob) - 5, len(blob) - 1):
        bad = bytearray(blob)
        bad[at] ^= 0x80
        with pytest.raises(BlobError, match="checksum"):
            read_header(bytes(bad))


def v1_blob(blob: bytes) -> bytes:
    """The same page as format version 1 wrote it: same layout, version byte 1, zlib CRC-32 trailer."""
    body = blob[:4] + b"\x01" + blob[5:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_version_1_blob_is_refused_naming_both_versions():
    key = key_of(SPEC)
    old = v1_blob(encode_page(page_of(SPEC), SPEC, key))
    assert zlib.crc32(old[:-4]) == struct.unpack("<I", old[-4:])[0]  # a well-formed v1 blob
    for read in (lambda: read_header(old), lambda: read_header(old, check_crc=False),
                 lambda: decode_page(old, SPEC, key)):
        with pytest.raises(BlobError, match=r"version 1 \(this build reads 2\)"):
            read()


def test_version_1_blobs_left_on_disk_are_misses_and_deleted(tmp_path):
    keys = [key_of(SPEC, 0), key_of(SPEC, 4)]
    blobs = [encode_page(page_of(SPEC, seed=i), SPEC, k) for i, k in enumerate(keys)]
    (tmp_path / keys[0].hex()).write_bytes(v1_blob(blobs[0]))  # left by the previous build
    (tmp_path / keys[1].hex()).write_bytes(blobs[1])
    disk = DiskTier(tmp_path, "1MiB")
    assert disk.contains(keys) == [False, True]  # its header is read at start: dropped then
    assert disk.get(keys) == [None, blobs[1]]
    assert disk.stats().corrupt == 1 and disk.contains(keys) == [False, True]
    assert not (tmp_path / keys[0].hex()).exists()


def test_without_the_blosc2_package_a_blosc2_blob_is_a_miss_and_the_codec_is_refused(monkeypatch):
    import sys

    from tiered_cache.config import CacheConfig

    page, key = page_of(SPEC, smooth=True), key_of(SPEC)
    blob = encode_page(page, SPEC, key, Codec.BLOSC2, min_saving=0)
    monkeypatch.setitem(sys.modules, "blosc2", None)  # what a reader without the package sees on import
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "blosc2" else object())
    with pytest.raises(BlobError, match="blosc2 package is not installed"):
        decode_page(blob, SPEC, key)
    with pytest.raises(ValueError, match="codec 'blosc2' needs the blosc2 package"):
        CacheConfig(codec="blosc2")
