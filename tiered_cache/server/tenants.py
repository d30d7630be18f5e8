"""Tenants: tokens scoped to namespaces, and the keyspace each namespace gets in the store.

A token file lists one token per line with the namespaces it may read and write:

    # token                          namespaces
    3f9c...e1                        team-a
    7b21...0d                        team-b, team-b-eval
    c0de...99                        *

`*` grants every namespace (an operator's token). A client names its namespace in the metadata
`tiered-cache-namespace`; without it, a call acts in its token's first namespace (the empty
namespace for `*` and for a server with one `--token`, which is today's single shared space).

The server keeps each namespace's pages under keys of their own: the key a client sends, hashed
with the namespace (`wire/namespaces.py`: `scoped_key`; the empty namespace keeps keys as they
are). So a client of tenant A asking for tenant B's page keys finds nothing, and its Puts of those
keys go into A's space, never over B's pages. A blob stored that way carries the namespace's key
(`codec.rekeyed`: every tier checks the key a blob carries) and goes back to its client carrying
the key the client asked for.
Same-host shared memory (the arena a client maps, the client's ring the server reads Puts from)
is not scoped: the server offers it only to calls acting in the empty namespace, so a scoped
tenant's pages travel as bytes over gRPC.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from tiered_cache.wire.auth import check_token
from tiered_cache.wire.namespaces import EVERY, check_namespace


@dataclass(frozen=True)
class Grant:
    """What one token may do: the namespaces it may use (`every`: all of them), the first its default."""

    namespaces: tuple[str, ...]
    every: bool = False

    def namespace(self, asked: str | None) -> str:
        """The namespace a call acts in: `asked`, or the token's default; PermissionError when the
        token may not use `asked`."""
        if asked is None:
            return "" if self.every else self.namespaces[0]
        if self.every or asked in self.namespaces:
            return asked
        raise PermissionError(f"this token may not use namespace {asked!r} (it may use: "
                              f"{', '.join(repr(n) for n in self.namespaces)})")


class Grants:
    """Tokens and what each may do. Empty: the server takes no token (anyone may use any namespace)."""

    def __init__(self, grants: dict[str, Grant] | None = None) -> None:
        self._grants = {f"Bearer {token}".encode(): grant for token, grant in (grants or {}).items()}

    @classmethod
    def single(cls, token: str | None) -> Grants:
        """One token for everything (`serve --token`): every namespace, the empty one by default."""
        return cls({token: Grant((), every=True)} if token else None)

    @classmethod
    def from_file(cls, path: str | Path) -> Grants:
        """The token file at `path` (module doc); ValueError naming the file and line of a mistake."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"token file {str(path)!r}: {exc.strerror or exc}") from None
        grants: dict[str, Grant] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"token file {str(path)!r} line {number}"
            token, _, rest = line.partition(" ")
            names = [n.strip() for n in rest.split(",")] if rest.strip() else []
            if not names or any(not n for n in names):
                raise ValueError(f"{where}: expected 'TOKEN NAMESPACE[, NAMESPACE...]' (or 'TOKEN *')")
            check_token(token, f"{where}: the token")
            if token in grants:
                raise ValueError(f"{where}: this token is listed twice")
            if EVERY in names:
                if names != [EVERY]:
                    raise ValueError(f"{where}: '*' already grants every namespace; list it alone")
                grants[token] = Grant((), every=True)
            else:
                grants[token] = Grant(tuple(check_namespace(n, f"{where}:") for n in dict.fromkeys(names)))
        if not grants:
            raise ValueError(f"token file {str(path)!r} lists no token: a server with a token file takes only "
                             "the tokens it lists")
        return cls(grants)

    def __bool__(self) -> bool:
        return bool(self._grants)

    def __len__(self) -> int:
        return len(self._grants)

    def grant_for(self, authorization: str | bytes) -> Grant | None:
        """The grant of an `authorization` metadata value (`Bearer TOKEN`), None for an unknown one.
        Every known token is compared, each in constant time."""
        sent = authorization.encode() if isinstance(authorization, str) else bytes(authorization)
        found = None
        for expected, grant in self._grants.items():
            if hmac.compare_digest(sent, expected):
                found = grant
        return found

    def operator_tokens(self) -> list[str]:
        """The tokens that grant every namespace (the metrics endpoint takes any of them)."""
        return [expected.decode()[len("Bearer "):] for expected, grant in self._grants.items() if grant.every]
