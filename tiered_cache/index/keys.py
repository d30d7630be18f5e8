"""Content-addressed page keys (DESIGN.md §4, a contract).

    root    = SHA-256( u32le(len(ns)) || ns (UTF-8) || fingerprint (32 raw bytes) )
    key[0]  = SHA-256( root     || tokens[0:p]      as little-endian int32 )
    key[i]  = SHA-256( key[i-1] || tokens[i*p:(i+1)*p] as little-endian int32 )

Only full pages get keys. Because each key chains the one before it, equal `key[i]` means the
whole prefix up to page i is equal, in the same namespace and for the same model geometry.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from tiered_cache.index.tokens import as_token_array
from tiered_cache.model.spec import KVSpec

KEY_BYTES = 32
_sha256 = hashlib.sha256


def root_key(namespace: str, fingerprint: str) -> bytes:
    """The chain's root for one namespace and one `KVSpec.fingerprint` (64 hex characters)."""
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    try:
        fp = bytes.fromhex(fingerprint)
    except (TypeError, ValueError):
        fp = b""
    if len(fp) != KEY_BYTES:
        raise ValueError(f"fingerprint must be 64 hex characters (SHA-256), got {fingerprint!r}")
    ns = namespace.encode("utf-8")
    return _sha256(struct.pack("<I", len(ns)) + ns + fp).digest()


def chain_keys(tokens: Any, page_size: int, parent: bytes) -> list[bytes]:
    """Keys of the full pages of `tokens`, chained from `parent` (a root or the previous page's key).

    A trailing partial page gets no key. Use this to extend a known prefix without rehashing it.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    data = as_token_array(tokens).tobytes()
    step = 4 * page_size
    keys: list[bytes] = []
    prev = parent
    for offset in range(0, len(data) - step + 1, step):
        prev = _sha256(prev + data[offset:offset + step]).digest()
        keys.append(prev)
    return keys


class PageKeyer:
    """Page keys for one model spec and one namespace: `PageKeyer(spec, "tenant-a").keys(tokens)`."""

    def __init__(self, spec: KVSpec, namespace: str = "") -> None:
        self.spec = spec
        self.namespace = namespace
        self.root = root_key(namespace, spec.fingerprint)

    def keys(self, tokens: Any) -> list[bytes]:
        """One key per full page of `tokens`."""
        return chain_keys(tokens, self.spec.page_size, self.root)

    def extend(self, last_key: bytes | None, tokens: Any) -> list[bytes]:
        """Keys of the full pages of `tokens`, which follow the page keyed `last_key` (None: the start)."""
        return chain_keys(tokens, self.spec.page_size, self.root if last_key is None else last_key)
