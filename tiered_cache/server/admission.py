"""What every read of the store admits before it reads, the same for gRPC's Lookup and Get and
for the bulk Get (bulk_gets.py): the namespace a call acts in, by its token's grant
(tenants.py), and how many keys of what size. Each check returns what passed or raises with a
message for the caller to send: ValueError for a malformed request (INVALID_ARGUMENT),
PermissionError for one its token may not make (PERMISSION_DENIED)."""

from __future__ import annotations

from collections.abc import Sequence

from tiered_cache.index.keys import KEY_BYTES
from tiered_cache.server.tenants import Grants
from tiered_cache.wire.namespaces import check_namespace


def admitted_namespace(grants: Grants | None, authorization: str, asked: str | None, where: str) -> str:
    """The namespace a call acts in: `asked` (None: the call names none; checked, naming `where`),
    or its token's first. Without grants any call may use any namespace."""
    if asked is not None:
        check_namespace(asked, where)
    if not grants:
        return asked or ""
    grant = grants.grant_for(authorization)
    if grant is None:
        raise PermissionError("missing or wrong token: send the server's token")
    return grant.namespace(asked)


def admitted_count(count: int, max_keys: int, least: int = 0) -> int:
    """`count` keys in one request, at least `least` and at most `max_keys`."""
    if count > max_keys or count < least:
        bound = f"between {least} and {max_keys}" if least else f"the limit is {max_keys}"
        raise ValueError(f"{count} keys in one request; {bound}")
    return count


def admitted_keys(keys: Sequence[bytes], max_keys: int) -> list[bytes]:
    """`keys` of one request: at most `max_keys`, each a page key (SHA-256, `KEY_BYTES` bytes)."""
    admitted_count(len(keys), max_keys)
    for i, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise ValueError(f"key {i} is {len(key)} bytes; page keys are {KEY_BYTES} bytes (SHA-256)")
    return list(keys)
