import numpy as np
import pytest
import torch

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import DType, KVSpec, Layout
from tiered_cache.tiers.codec import BlobError, Codec, decode_page, encode_page, read_header, verify_blob

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


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.LZ4, Codec.LZ4_SHUFFLE])
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
        assert header.codec is codec and len(blob) < spec.bytes_per_page / 2
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


def test_check_crc_false_skips_only_the_checksum():
    key = key_of(SPEC)
    blob = bytearray(encode_page(page_of(SPEC), SPEC, key))
    blob[-10] ^= 0x01  # payload bit flip: only the CRC can see it
    decode_page(bytes(blob), SPEC, key, check_crc=False)
    with pytest.raises(BlobError, match="checksum"):
        decode_page(bytes(blob), SPEC, key)
    with pytest.raises(BlobError, match="asked for"):  # key, fingerprint and lengths are still checked
        decode_page(bytes(blob), SPEC, key_of(SPEC, 50), check_crc=False)
