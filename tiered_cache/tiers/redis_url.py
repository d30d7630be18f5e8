"""What a Redis URL means to the Redis tier: a `redis+cluster://` URL's startup nodes and
connection settings, and the retry policy every connection is pinned to."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]] | None:
    """The startup nodes (host, port) and connection settings of a `redis+cluster://` URL, or
    None for any other URL. Raises ValueError for a cluster URL that is not of the form above."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        return None
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0 and takes no options; got '/{path}' in its URL")
    userinfo, at, hosts = netloc.rpartition("@")
    settings: dict[str, Any] = {"ssl": True} if CLUSTER_SCHEMES[scheme.lower()] else {}
    if at:
        user, colon, password = userinfo.partition(":")
        settings.update({"username": unquote(user) or None, "password": unquote(password) if colon else None})
    nodes = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not (colon and host and port.isdigit()):
            raise ValueError(f"expected HOST:PORT[,HOST:PORT...] in a {scheme}:// URL, got {part.strip()!r}")
        nodes.append((host.strip("[]"), int(port)))
    return nodes, settings


def retry_policy() -> Any:
    """redis-py's retry inside one call: once, after 2-10 ms, and only for a broken connection."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.retry import Retry

    return Retry(ExponentialBackoff(cap=0.01, base=0.002), 1, supported_errors=(RedisConnectionError,))
