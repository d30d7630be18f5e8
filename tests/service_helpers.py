"""Blobs for service tests."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import torch

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.wire import codec
from tiered_cache.wire.codec import blob_checksum, encode_page

SPEC = KVSpec("service-test", 2, 2, 32, page_size=4)  # 2 KiB pages
FINGERPRINT = bytes.fromhex(SPEC.fingerprint)


def make_items(n: int, start: int = 0, seed: int = 0, spec: KVSpec = SPEC) -> list[tuple[bytes, bytes]]:
    keys = PageKeyer(spec, "svc").keys(list(range(start, start + n * spec.page_size)))
    pages = torch.randn(spec.staging_shape(n), generator=torch.Generator().manual_seed(seed)).half()
    return [(k, encode_page(p, spec, k)) for k, p in zip(keys, pages, strict=True)]


def with_codec_byte(blob: bytes, codec_id: int) -> bytes:
    """The same blob claiming another codec, with a valid checksum (so only the codec is wrong)."""
    body = blob[:5] + bytes([codec_id]) + blob[6:-4]
    return body + struct.pack("<I", blob_checksum(body))


def large_items(num_pages: int) -> list[tuple[bytes, bytes]]:
    """Pages of 256 KiB: a stream of them is still in flight when a test interrupts it."""
    spec = KVSpec("large-pages", 8, 8, 128, page_size=8)
    keys = PageKeyer(spec).keys(list(range(num_pages * spec.page_size)))
    page = torch.randn(spec.staging_shape(1)[1:]).half()
    return [(k, encode_page(page, spec, k)) for k in keys]


def checksummed(spec: KVSpec, codec_id: int, dtype_id: int, shape: tuple[int, ...], raw_len: int,
                payload: bytes, key: bytes) -> bytes:
    """A blob with these header fields and a correct checksum, whatever the fields say."""
    body = struct.pack("<4sBBBB32s32sIIQQ", codec.MAGIC, codec.VERSION, codec_id, dtype_id, len(shape),
                       bytes.fromhex(spec.fingerprint), key, spec.page_size, 0, raw_len, len(payload))
    body += struct.pack(f"<{len(shape)}I", *shape) + payload
    return body + struct.pack("<I", codec.blob_checksum(body))


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A throwaway certificate for localhost and 127.0.0.1 and its key (openssl): (cert, key)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key
