"""Namespaces on the wire: the metadata a client names its namespace in, what a namespace may be
called, and the key a store server keeps a namespace's page under (server/tenants.py says who may
use which)."""

from __future__ import annotations

import hashlib

NAMESPACE_METADATA = "tiered-cache-namespace"
EVERY = "*"  # in a token file: every namespace
_SCOPE = b"tiered-cache/namespace\0"
_MAX_NAMESPACE = 128


def scoped_key(namespace: str, key: bytes) -> bytes:
    """The key the store keeps page `key` of `namespace` under (`key` itself in the empty one)."""
    if not namespace:
        return key
    return hashlib.sha256(_SCOPE + namespace.encode() + b"\0" + key).digest()


def scoped_keys(namespace: str, keys: list[bytes]) -> list[bytes]:
    """`scoped_key` of each of `keys` (the same list in the empty namespace)."""
    return [scoped_key(namespace, key) for key in keys] if namespace else keys


def check_namespace(name: str, where: str = "namespace") -> str:
    """`name` unchanged when it is a usable namespace; ValueError naming `where` otherwise."""
    if len(name) > _MAX_NAMESPACE or not all(0x21 <= ord(c) < 0x7F and c != "," for c in name) or name == EVERY:
        raise ValueError(f"{where} {name!r} is not a namespace: up to {_MAX_NAMESPACE} printable ASCII characters, "
                         f"no spaces or commas, not '*'")
    return name
