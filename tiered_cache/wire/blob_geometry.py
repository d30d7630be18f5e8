"""What a store server can check of a page blob without knowing its model.

The server serves every model and never decodes pages for use, so it cannot tell a page of the
wrong model from a right one. What it can tell: whether the header's own page geometry holds
together (the raw length is the shape times the dtype's size, the shape is (layers, K/V, ...)
with the page's tokens in it) and whether the payload decodes to that many bytes under its
codec. A blob that fails either would be refused by every reader; stored, it would answer for
its key forever. Checked at Put, it is refused there instead.

A blob that passes can still be a page of another model under this key (the server cannot know
the reader's model): `codec.page_identity` names the page a blob claims to be, and a Put whose
identity differs from the held blob's replaces it (server/store.py), so one bad writer cannot
block a prefix for good: the reader that refused it recomputes and puts the real page.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tiered_cache.wire.codec import (
    BlobError,
    BlobFault,
    BlobHeader,
    Codec,
    blosc2_decode,
    check_int8_payload,
    lz4_decompress,
)


def check_geometry(blob: Any, header: BlobHeader) -> None:
    """Raise BlobError unless the header's page geometry is consistent and the payload decodes
    to `raw_len` bytes under its codec (a checksummed blob can still lie about either)."""
    shape = header.shape
    if header.num_tokens < 1 or not all(shape) or header.raw_len < 1:  # a page of nothing: no KV to reuse
        raise BlobError(f"page shape {shape} with {header.num_tokens} tokens holds no KV: not a page",
                        BlobFault.WRONG_SHAPE)
    if len(shape) < 3 or shape[1] != 2 or header.num_tokens not in shape[2:]:
        raise BlobError(f"page shape {shape} is not (layers, 2, ...) holding its {header.num_tokens} tokens",
                        BlobFault.WRONG_SHAPE)
    if header.raw_len != math.prod(shape) * header.dtype.itemsize:
        raise BlobError(f"raw length {header.raw_len:,} is not shape {shape} x {header.dtype.itemsize} bytes "
                        f"({header.dtype.value})", BlobFault.WRONG_SHAPE)
    payload = memoryview(blob).cast("B")[header.payload_offset:header.payload_offset + header.payload_len]
    _check_decodes(header, payload)


def _check_decodes(header: BlobHeader, payload: memoryview) -> None:
    codec, raw_len = header.codec, header.raw_len
    if codec is Codec.RAW:
        if len(payload) != raw_len:
            raise BlobError(f"raw payload is {len(payload):,} bytes, expected {raw_len:,}")
    elif codec is Codec.INT8:
        check_int8_payload(header.dtype, header.shape[-1], raw_len, len(payload))
    elif codec is Codec.BLOSC2:
        _check_blosc2(payload, raw_len)
    else:  # lz4, lz4-shuffle (the shuffle only reorders the decompressed bytes)
        lz4_decompress(payload, raw_len)


def _check_blosc2(payload: memoryview, raw_len: int) -> None:
    import importlib.util

    if importlib.util.find_spec("blosc2") is None:
        return  # a server without blosc2 cannot decode it; its readers can, and check it themselves
    blosc2_decode(payload, raw_len, np.empty(raw_len, dtype=np.uint8))
