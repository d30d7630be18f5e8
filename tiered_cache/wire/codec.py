"""The page blob (DESIGN.md §5, a contract): one page outside the process, self-describing.

    offset  size  field
    0       4     magic b"TCKV"
    4       1     format version (2; version 1 has the same layout with a zlib CRC-32)
    5       1     codec (Codec.wire_id)
    6       1     dtype (index in _DTYPES)
    7       1     ndim of the page shape
    8       32    spec fingerprint (raw SHA-256)
    40      32    page key
    72      4     tokens in the page (u32)
    76      4     reserved, 0
    80      8     raw length: bytes of the decoded page (u64)
    88      8     payload length (u64)
    96      4*nd  page shape, u32 each
    ...     n     payload
    end-4   4     CRC-32C (Castagnoli) over everything before it

All little-endian. A blob whose magic, version, codec, key, fingerprint, lengths or checksum do not
match what the reader expects raises `BlobError`; callers treat that as a miss and delete the blob.
CRC-32C (SSE4.2 in C, several times zlib's CRC-32: `checksum.py`) guards against truncation
and bit rot; the key and fingerprint in the header guard against a blob answering for another page
or another model. A blob of another version (v1 included) is a `BlobError`, so a miss: never decoded.
"""

from __future__ import annotations

import enum
import itertools
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiered_cache.errors import TieredCacheError
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.wire.checked_copy import copy_bytes, copy_crc
from tiered_cache.wire.checksum import crc32c_extend

MAGIC = b"TCKV"
VERSION = 2
_HEADER = struct.Struct("<4sBBBB32s32sIIQQ")
_CRC = struct.Struct("<I")
# CRC-32C of any bytes followed by their own CRC-32C (little-endian): a constant of the polynomial.
_CRC_RESIDUE = 0x48674BC7
_DTYPES = (DType.FP16, DType.BF16, DType.FP32, DType.FP8_E4M3)
DEFAULT_MIN_SAVING = 0.05


class BlobFault(enum.Enum):
    """Why a blob was refused (the gRPC store reports it to the client)."""

    CORRUPT = "corrupt"  # magic, version, lengths or checksum
    WRONG_KEY = "wrong key"
    WRONG_FINGERPRINT = "wrong fingerprint"
    UNKNOWN_CODEC = "unknown codec"
    WRONG_SHAPE = "wrong shape"


class BlobError(TieredCacheError, ValueError):
    """A blob that must not be used: corrupt, truncated, or not the page that was asked for."""

    def __init__(self, message: str, fault: BlobFault = BlobFault.CORRUPT) -> None:
        super().__init__(message)
        self.fault = fault


class Codec(enum.Enum):
    RAW = "raw"
    LZ4 = "lz4"
    LZ4_SHUFFLE = "lz4-shuffle"  # byte planes first: exponent bytes compress, mantissas do not
    INT8 = "int8"  # lossy: per-token, per-head absmax scales; opt-in only
    # c-blosc2's bitshuffle + LZ4 (one thread): on real bf16 KV it saves more than lz4-shuffle and
    # encodes/decodes faster (docs/PERFORMANCE.md, "Codecs"): the compressing codec to choose.
    BLOSC2 = "blosc2"

    @property
    def wire_id(self) -> int:
        return _WIRE_IDS[self]

    @property
    def lossy(self) -> bool:
        return self is Codec.INT8

    @classmethod
    def parse(cls, value: Codec | str) -> Codec:
        if isinstance(value, Codec):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"unknown codec {value!r}; expected one of: "
                             f"{', '.join(c.value for c in cls)}") from None


_WIRE_IDS = {Codec.RAW: 0, Codec.LZ4: 1, Codec.LZ4_SHUFFLE: 2, Codec.INT8: 3, Codec.BLOSC2: 4}
_BY_WIRE_ID = {v: k for k, v in _WIRE_IDS.items()}


@dataclass(frozen=True)
class BlobHeader:
    codec: Codec
    dtype: DType
    fingerprint: bytes
    key: bytes
    num_tokens: int
    raw_len: int
    shape: tuple[int, ...]
    payload_offset: int
    payload_len: int


def page_bytes_view(page: Any) -> np.ndarray:
    """A flat uint8 view (no copy when contiguous on the CPU) of a page from numpy or torch."""
    if hasattr(page, "detach") and hasattr(page, "cpu"):
        import torch

        page = page.detach()
        if page.device.type != "cpu":
            page = page.cpu()
        return page.contiguous().view(torch.uint8).reshape(-1).numpy()
    arr = np.ascontiguousarray(page)
    return arr.reshape(-1).view(np.uint8)


# --- encode -----------------------------------------------------------------------------------------
def encode_page(page: Any, spec: KVSpec, key: bytes, codec: Codec | str = Codec.RAW,
                min_saving: float = DEFAULT_MIN_SAVING) -> bytes:
    """One page of `spec` (page-first, `spec.staging_shape(1)[1:]`) as a blob.

    A lossless codec whose output is not at least `min_saving` smaller than the page stores the
    page raw (the header says so). Raises ValueError for a page of the wrong size or a bad key.
    """
    codec = Codec.parse(codec)
    raw = page_bytes_view(page)
    if raw.size != spec.bytes_per_page:
        raise ValueError(f"a page of {spec.model_id} is {spec.bytes_per_page:,} bytes, got {raw.size:,}")
    if len(key) != 32:
        raise ValueError(f"page key must be 32 bytes, got {len(key)}")
    if codec is Codec.INT8:
        return _assemble(spec, key, Codec.INT8, _int8_encode(raw, spec))
    if codec in (Codec.LZ4, Codec.LZ4_SHUFFLE):
        import lz4.block

        source = _shuffle(raw, spec.dtype.itemsize) if codec is Codec.LZ4_SHUFFLE else raw
        packed = lz4.block.compress(source, store_size=False)
    elif codec is Codec.BLOSC2:
        packed = _blosc2_encode(raw, spec.dtype.itemsize)
    else:
        return _assemble(spec, key, Codec.RAW, raw)
    if len(packed) <= raw.size * (1 - min_saving):  # a lossless codec must pay for itself
        return _assemble(spec, key, codec, packed)
    return _assemble(spec, key, Codec.RAW, raw)


def _blosc2_encode(raw: np.ndarray, itemsize: int) -> bytes:
    import blosc2

    # One thread: pages are encoded by the background writer, beside the request path.
    return blosc2.compress2(raw, typesize=itemsize, clevel=5, codec=blosc2.Codec.LZ4,
                            filters=[blosc2.Filter.BITSHUFFLE], nthreads=1)


def blosc2_decode(payload: memoryview, raw_len: int, out: np.ndarray) -> None:
    """Decode a blosc2 chunk into `out`, after checking its own sizes against the header's: a
    chunk that claims more bytes than the page would write past `out`. Without the blosc2
    package here the blob is refused (a miss), like any blob this reader cannot decode."""
    try:
        import blosc2
    except ImportError:
        raise BlobError("the blob is blosc2-encoded and the blosc2 package is not installed here "
                        "(pip install blosc2)") from None

    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(payload)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise BlobError(f"blosc2 payload has no valid chunk header: {exc}") from None
    if nbytes != raw_len or cbytes != len(payload) or out.size != raw_len:
        raise BlobError(f"blosc2 chunk holds {nbytes} bytes in {cbytes}, expected {raw_len} in {len(payload)}")
    try:
        blosc2.decompress2(payload, dst=out, nthreads=1)
    except (RuntimeError, ValueError) as exc:
        raise BlobError(f"blosc2 payload does not decompress: {exc}") from None


def _assemble(spec: KVSpec, key: bytes, codec: Codec, payload: Any) -> bytes:
    shape = spec.staging_shape(1)[1:]
    header = _HEADER.pack(MAGIC, VERSION, codec.wire_id, _DTYPES.index(spec.dtype), len(shape),
                          bytes.fromhex(spec.fingerprint), key, spec.page_size, 0,
                          spec.bytes_per_page, len(payload)) + struct.pack(f"<{len(shape)}I", *shape)
    data = memoryview(payload).cast("B")
    # One copy of the payload (join), the checksum chained over header then payload in place.
    return b"".join((header, data, _CRC.pack(blob_checksum(header, data))))


_KEY_AT = struct.calcsize("<4sBBBB32s")  # where a blob's page key starts in its header


def rekeyed(blob: Any, key: bytes) -> bytes:
    """A copy of the (verified) `blob` carrying page key `key` instead, its checksum made anew: a
    store server keeps a namespace's pages under keys of that namespace (wire/namespaces.py), and
    every tier it reads them from checks the key the blob carries."""
    if len(key) != 32:
        raise ValueError(f"a page key is 32 bytes, got {len(key)}")
    out = bytearray(blob)
    out[_KEY_AT:_KEY_AT + 32] = key
    _CRC.pack_into(out, len(out) - _CRC.size, blob_checksum(memoryview(out)[:-_CRC.size]))
    return bytes(out)


def _require_residue(crc: int) -> None:
    """A whole blob, trailer included, checksums to the residue iff the trailer is its CRC."""
    if crc != _CRC_RESIDUE:
        raise BlobError("blob checksum mismatch: the bytes were corrupted")


def blob_checksum(*parts: Any) -> int:
    """CRC-32C of `parts` (contiguous buffers) as if joined, without joining them: a blob's trailer."""
    crc = 0
    for part in parts:
        crc = crc32c_extend(crc, part)
    return crc


def _shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return raw
    items = raw.reshape(-1, itemsize)
    planes = np.empty((itemsize, items.shape[0]), dtype=np.uint8)
    for j in range(itemsize):  # plane assignment: far faster than items.T.copy()
        planes[j] = items[:, j]
    return planes


def _unshuffle(planes_flat: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    if itemsize == 1:
        out[:] = planes_flat
        return
    planes = planes_flat.reshape(itemsize, -1)
    items = out.reshape(-1, itemsize)
    for j in range(itemsize):
        items[:, j] = planes[j]


# --- int8 (lossy) -----------------------------------------------------------------------------------
def _to_float32(raw: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is DType.FP16:
        return raw.view(np.float16).astype(np.float32)
    if dtype is DType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype is DType.FP32:
        return raw.view(np.float32)
    raise ValueError(f"the int8 codec needs fp16, bf16 or fp32 KV, not {dtype.value}")


def _from_float32(values: np.ndarray, dtype: DType, out: np.ndarray) -> None:
    if dtype is DType.FP16:
        out.view(np.float16)[:] = values
    elif dtype is DType.BF16:  # round to nearest even, as torch does
        bits = values.view(np.uint32)
        out.view(np.uint16)[:] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        out.view(np.float32)[:] = values


def _int8_encode(raw: np.ndarray, spec: KVSpec) -> bytes:
    rows = _to_float32(raw, spec.dtype).reshape(-1, spec.head_dim)  # one row per (layer, K/V, token, head)
    scales = (np.abs(rows).max(axis=1) / 127.0).astype(np.float16)
    s32 = scales.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        quant = np.where(s32 > 0, np.rint(rows / s32), 0).clip(-127, 127).astype(np.int8)
    return scales.tobytes() + quant.tobytes()


def check_int8_payload(dtype: DType, head_dim: int, raw_len: int, payload_len: int) -> int:
    """Raise BlobError unless an int8 payload of `payload_len` bytes can hold `raw_len` bytes of
    `dtype` KV in rows of `head_dim`; returns the rows (each one fp16 scale, head_dim int8s)."""
    if dtype not in (DType.FP16, DType.BF16, DType.FP32):  # what _int8_encode accepts
        raise BlobError(f"an int8 blob cannot hold {dtype.value} KV (int8 is for fp16, bf16, fp32)",
                        BlobFault.UNKNOWN_CODEC)
    rows = raw_len // dtype.itemsize // head_dim
    if payload_len != rows * (2 + head_dim):
        raise BlobError(f"int8 payload is {payload_len} bytes, expected {rows * (2 + head_dim)}")
    return rows


def lz4_decompress(payload: Any, raw_len: int) -> bytes:
    """The `raw_len` bytes an lz4 block payload holds; BlobError when it does not decompress to them."""
    import lz4.block

    try:
        data = lz4.block.decompress(payload, uncompressed_size=raw_len)
    except lz4.block.LZ4BlockError as exc:
        raise BlobError(f"lz4 payload does not decompress: {exc}") from None
    if len(data) != raw_len:
        raise BlobError(f"lz4 payload gave {len(data)} bytes, expected {raw_len}")
    return data


def _int8_decode(payload: memoryview, spec: KVSpec, out: np.ndarray) -> None:
    rows = check_int8_payload(spec.dtype, spec.head_dim, spec.bytes_per_page, len(payload))
    scales = np.frombuffer(payload, dtype=np.float16, count=rows).astype(np.float32)
    quant = np.frombuffer(payload, dtype=np.int8, offset=rows * 2).reshape(rows, spec.head_dim)
    _from_float32((quant.astype(np.float32) * scales[:, None]).reshape(-1), spec.dtype, out)


# --- decode -----------------------------------------------------------------------------------------
def read_header(blob: Any, check_crc: bool = True) -> BlobHeader:
    """Parse and sanity-check a blob's header and (unless told it was just checked) its checksum.
    Raises BlobError."""
    view = memoryview(blob).cast("B")
    header = _parse_header(view, len(view))
    # The whole blob, trailer included, checksums to the residue iff the trailer is the CRC of the
    # rest: no slice, so a bytes blob is read in place (and without the GIL from 1 MiB).
    if check_crc:
        _require_residue(blob_checksum(blob if isinstance(blob, bytes) else view))
    return header


def _parse_header(view: memoryview, blob_len: int) -> BlobHeader:
    """The header at the start of `view` (at least the header's bytes) of a blob `blob_len` bytes
    long, its fields sanity-checked (not the checksum). Raises BlobError."""
    if len(view) < _HEADER.size or blob_len < _HEADER.size + _CRC.size:
        raise BlobError(f"blob truncated: {min(len(view), blob_len)} bytes is shorter than a header")
    magic, version, codec_id, dtype_id, ndim, fp, key, tokens, _, raw_len, payload_len = \
        _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BlobError(f"not a page blob: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise BlobError(f"unknown blob format version {version} (this build reads {VERSION})")
    if codec_id not in _BY_WIRE_ID or dtype_id >= len(_DTYPES):
        raise BlobError(f"unknown codec id {codec_id} or dtype id {dtype_id}", BlobFault.UNKNOWN_CODEC)
    offset = _HEADER.size + 4 * ndim
    expected_len = offset + payload_len + _CRC.size
    if blob_len != expected_len or len(view) < offset:
        raise BlobError(f"blob is {blob_len} bytes, its header says {expected_len} (truncated or padded)")
    shape = struct.unpack_from(f"<{ndim}I", view, _HEADER.size)
    return BlobHeader(_BY_WIRE_ID[codec_id], _DTYPES[dtype_id], bytes(fp), bytes(key), tokens, raw_len,
                      tuple(shape), offset, payload_len)


HEADER_BYTES = _HEADER.size


def expected_blob_size(head: Any) -> int:
    """The total size a blob must have, from its first `HEADER_BYTES` bytes alone: lets a store
    drop a truncated or padded file without reading it. Raises BlobError for a head that is not
    a current-version blob header."""
    view = memoryview(head).cast("B")
    if len(view) < _HEADER.size:
        raise BlobError(f"blob truncated: {len(view)} bytes is shorter than a header")
    magic, version, _, _, ndim, _, _, _, _, _, payload_len = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BlobError(f"not a page blob: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise BlobError(f"unknown blob format version {version} (this build reads {VERSION})")
    return _HEADER.size + 4 * ndim + payload_len + _CRC.size


def page_identity(head: Any) -> tuple[Any, ...]:
    """Which page of which model a blob claims to be, from its first `IDENTITY_BYTES` bytes (or
    all of it): (fingerprint, key, dtype, tokens, raw length, shape). Equal for two blobs of one
    page under different codecs. Raises BlobError for a head that is not a blob header."""
    view = memoryview(head).cast("B")
    expected_blob_size(view)  # magic and version
    _, _, _, dtype_id, ndim, fp, key, tokens, _, raw_len, _ = _HEADER.unpack_from(view)
    if len(view) < _HEADER.size + 4 * ndim:
        raise BlobError(f"blob truncated: {len(view)} bytes is shorter than its header")
    return bytes(fp), bytes(key), dtype_id, tokens, raw_len, struct.unpack_from(f"<{ndim}I", view, _HEADER.size)


IDENTITY_BYTES = _HEADER.size + 4 * 255  # the longest header (ndim is one byte)


def verify_blob(blob: Any, key: bytes, check_crc: bool = True) -> BlobHeader:
    """Header and checksum are intact and the blob is the page keyed `key`. Raises BlobError."""
    header = read_header(blob, check_crc)
    if header.key != key:
        raise BlobError(f"blob holds page {header.key.hex()[:16]}…, asked for {key.hex()[:16]}…",
                        BlobFault.WRONG_KEY)
    return header


def check_fingerprint(header: BlobHeader, fingerprint: bytes, model: str = "") -> None:
    """Raise BlobError unless the blob was made for the model with this (raw, 32-byte) fingerprint."""
    if header.fingerprint != fingerprint:
        raise BlobError(f"blob belongs to model fingerprint {header.fingerprint.hex()[:16]}…, expected "
                        f"{fingerprint.hex()[:16]}…{f' ({model})' if model else ''}", BlobFault.WRONG_FINGERPRINT)


def _checked_payload(blob: Any, spec: KVSpec, key: bytes, check_crc: bool) -> tuple[BlobHeader, memoryview]:
    """The header and payload of a blob that is the page `key` of `spec`; BlobError otherwise."""
    header = verify_blob(blob, key, check_crc)
    _check_page(header, spec)
    payload = memoryview(blob).cast("B")[header.payload_offset:header.payload_offset + header.payload_len]
    return header, payload


def _check_page(header: BlobHeader, spec: KVSpec) -> None:
    """Raise BlobError unless the blob holds a page of `spec`: model, shape, dtype, lengths."""
    check_fingerprint(header, bytes.fromhex(spec.fingerprint), spec.model_id)
    expected_shape = spec.staging_shape(1)[1:]
    if header.shape != expected_shape or header.dtype is not spec.dtype or header.raw_len != spec.bytes_per_page:
        raise BlobError(f"blob page is {header.shape} {header.dtype.value}, expected {expected_shape} "
                        f"{spec.dtype.value}", BlobFault.WRONG_SHAPE)
    if header.codec is Codec.RAW and header.payload_len != header.raw_len:
        raise BlobError(f"raw payload is {header.payload_len} bytes, expected {header.raw_len}")


def verify_raw_blob(blob: Any, spec: KVSpec, key: bytes) -> None:
    """Raise BlobError unless `blob` is an intact raw blob of page `key` of `spec` (header and
    checksum, read where it lies): a page a copier may take straight from the payload's bytes."""
    header, _ = _checked_payload(blob, spec, key, check_crc=True)
    if header.codec is not Codec.RAW:
        raise BlobError(f"blob is {header.codec.value}, not raw: it must be decoded")


def page_view(blob: Any, spec: KVSpec, key: bytes, check_crc: bool = True) -> np.ndarray:
    """The page's bytes (flat uint8), as `decode_page` gives them, but a read-only view into `blob`
    when it is stored raw: no copy, for a caller that copies the page somewhere itself."""
    header, payload = _checked_payload(blob, spec, key, check_crc)
    if header.codec is Codec.RAW:
        return np.frombuffer(payload, dtype=np.uint8)
    return decode_page(blob, spec, key, check_crc=False)


def decode_page(blob: Any, spec: KVSpec, key: bytes, out: np.ndarray | None = None,
                check_crc: bool = True) -> np.ndarray:
    """The page's bytes (flat uint8, `spec.bytes_per_page` long), written into `out` if given.

    Raises BlobError for any mismatch with `spec` and `key`: corrupt KV is never returned.
    `check_crc=False` skips only the checksum, for a blob a tier verified a moment ago.
    """
    header, payload = _checked_payload(blob, spec, key, check_crc)
    if out is None:
        out = np.empty(spec.bytes_per_page, dtype=np.uint8)
    if header.codec is Codec.RAW:
        out[:] = np.frombuffer(payload, dtype=np.uint8)
    elif header.codec is Codec.INT8:
        _int8_decode(payload, spec, out)
    elif header.codec is Codec.BLOSC2:
        blosc2_decode(payload, header.raw_len, out)
    else:
        flat = np.frombuffer(lz4_decompress(payload, header.raw_len), dtype=np.uint8)
        if header.codec is Codec.LZ4_SHUFFLE:
            _unshuffle(flat, spec.dtype.itemsize, out)
        else:
            out[:] = flat
    return out


# --- straight into a destination --------------------------------------------------------------------
# A page's destination is a uint8 numpy array holding its bytes in page-first order (the C order
# of its axes), with any strides: a row of a staging buffer is contiguous; on a CPU pool a page's
# (layers, 2, bytes) blocks lie strided inside the layer-first pool itself. Tiers with `get_into`
# write verified pages there without a blob per page in between: each fresh blob costs a copy,
# and fresh memory first-touch faults (far slower than a copy: docs/PERFORMANCE.md).
PageDest = np.ndarray


def raw_header_size(spec: KVSpec) -> int:
    """Bytes before the payload in a blob of a page of `spec`."""
    return _HEADER.size + 4 * len(spec.staging_shape(1)[1:])


def raw_blob_size(spec: KVSpec) -> int:
    """Bytes of a raw-coded blob of a page of `spec`: a stored blob of another size is compressed
    (or not a page of `spec` at all)."""
    return raw_header_size(spec) + spec.bytes_per_page + _CRC.size


def contiguous_dest(dest: PageDest) -> np.ndarray | None:
    """A flat view of a contiguous destination, writable in place (a file or socket read can write
    straight into it), or None for a strided one."""
    return dest.reshape(-1) if dest.flags.c_contiguous else None


def dest_parts(dest: PageDest) -> list[memoryview] | None:
    """The contiguous runs of a destination in page order (one for a contiguous array): what a
    read that scatters (`socket.recvmsg_into`) fills. None when its last axis is strided."""
    if dest.flags.c_contiguous:
        return [memoryview(dest.reshape(-1))]
    if dest.ndim == 0 or dest.strides[-1] != 1:
        return None
    return [memoryview(dest[index]) for index in itertools.product(*map(range, dest.shape[:-1]))]


def check_raw_pieces(header: Any, payload: Any, trailer: Any, spec: KVSpec, key: bytes) -> None:
    """Raise BlobError unless `header` + `payload` + `trailer`, a blob read in pieces (its payload
    straight into a destination: one buffer, or a list of them, e.g. `dest_parts`), are an intact
    raw blob of page `key` of `spec`. The checksum is computed over the pieces where they lie."""
    view = memoryview(header).cast("B")
    data = [memoryview(part).cast("B") for part in (payload if isinstance(payload, list) else [payload])]
    found = _parse_header(view, len(view) + sum(len(part) for part in data) + len(trailer))
    if found.key != key:
        raise BlobError(f"blob holds page {found.key.hex()[:16]}…, asked for {key.hex()[:16]}…", BlobFault.WRONG_KEY)
    _check_page(found, spec)
    if found.codec is not Codec.RAW or found.payload_offset != len(view):
        raise BlobError(f"blob is {found.codec.value} with its payload at {found.payload_offset}, read as a raw "
                        f"page at {len(view)}")
    _require_residue(blob_checksum(view, *data, trailer))


def decode_into(blob: Any, spec: KVSpec, key: bytes, dest: PageDest, check_crc: bool = True) -> None:
    """Decode page `key` of `spec` from `blob` into `dest` (a destination, above): one copy for a
    raw blob, however `dest` is strided. Raises BlobError, after which `dest` holds anything."""
    if dest.size != spec.bytes_per_page or dest.dtype != np.uint8:
        raise ValueError(f"a page of {spec.model_id} needs {spec.bytes_per_page:,} uint8, got a destination of "
                         f"{dest.size:,} {dest.dtype}")
    # A raw page is copied and checksummed in one pass (checked_copy.py), the checksum judged
    # after the copy: the caller owns `dest` until this returns, and whoever else could change
    # `blob` meanwhile (the arena's writer) is checked for by its caller after it.
    header, payload = _checked_payload(blob, spec, key, check_crc=False)
    if header.codec is Codec.RAW:
        if not check_crc:
            copy_bytes(payload, dest)
            return
        view = memoryview(blob).cast("B")
        crc = copy_crc(payload, dest, crc32c_extend(0, view[:header.payload_offset]))
        _require_residue(crc32c_extend(crc, view[header.payload_offset + header.payload_len:]))
        return
    if check_crc:
        read_header(blob)
    flat = contiguous_dest(dest)
    if flat is not None:
        decode_page(blob, spec, key, out=flat, check_crc=False)
        return
    page = decode_page(blob, spec, key, check_crc=False)  # a compressed page decodes contiguously first
    np.copyto(dest, page.reshape(dest.shape))
