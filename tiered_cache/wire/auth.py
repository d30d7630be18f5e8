"""Bearer tokens of the store service: one check, used by every path that takes a token.

A token is either unset (`None`: no authentication) or a real secret. An empty or blank token
is refused everywhere (server flag, environment variable, YAML, client), so that no path reads
it as "no token" and starts an open store by accident. A token travels as gRPC metadata
(`authorization: Bearer <token>`), which carries printable ASCII only.
"""

from __future__ import annotations

TOKEN_ENV = "TIERED_CACHE_SERVE_TOKEN"
TOKEN_FILE_ENV = "TIERED_CACHE_SERVE_TOKEN_FILE"  # tokens scoped to namespaces (server/tenants.py)


def check_token(token: str | None, where: str = "token") -> str | None:
    """`token` unchanged when it is None or usable; raises ValueError naming `where` otherwise."""
    if token is None:
        return None
    if not isinstance(token, str):
        raise ValueError(f"{where} must be a string, got {type(token).__name__}")
    if not token.strip():
        raise ValueError(f"{where} is empty or blank: set a real secret, or leave it unset for no authentication")
    if token != token.strip():
        raise ValueError(f"{where} starts or ends with whitespace: remove it (gRPC metadata cannot carry it)")
    bad = sorted({c for c in token if not (0x20 <= ord(c) < 0x7F)})
    if bad:
        raise ValueError(f"{where} holds characters gRPC metadata cannot carry ({', '.join(map(repr, bad))}): "
                         f"use printable ASCII")
    return token


def token_from(flag: str | None, environ: dict[str, str]) -> str | None:
    """The token a command was given: its flag when given (even empty: then refused), else
    $TIERED_CACHE_SERVE_TOKEN when set (even empty: then refused), else None."""
    if flag is not None:
        return check_token(flag, "--token")
    if TOKEN_ENV in environ:
        return check_token(environ[TOKEN_ENV], f"${TOKEN_ENV}")
    return None
