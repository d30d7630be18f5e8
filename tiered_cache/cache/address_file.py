"""`AddressFile`: the store servers' addresses kept in a file the remote tier follows
(`remote_addresses_file`), for processes that cannot ask the cluster's directory themselves: a
vLLM engine's scheduler and worker processes, whose replica actor writes the file from the
directory (workers/serve_llm/shard_list.py), or any deployment whose shards can move.

The file holds one HOST:PORT a line (blank lines and `#` comments skipped). A thread looks at it
every `every_s` and, when it changed, points the cache at what it lists (`set_remote_addresses`:
keys move to their new owners). A file that is missing, empty or does not parse leaves the ring
as it is: logged once, counted, never raised into a request.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from tiered_cache.config import CacheConfig
from tiered_cache.tiers.base import Tier
from tiered_cache.wire.options import normalize_address

log = logging.getLogger("tiered_cache.cache.address_file")
EVERY_S = 1.0


def read_addresses(path: str | Path) -> list[str]:
    """The addresses a file lists, each checked (ValueError naming the line otherwise)."""
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            out.append(normalize_address(line))
        except ValueError as exc:
            raise ValueError(f"{path}: line {number}: {exc}") from None
    if not out:
        raise ValueError(f"{path}: lists no address")
    return out


def write_addresses(path: str | Path, addresses: Sequence[str]) -> bool:
    """Write the list where readers see it whole (a rename), in a folder only this user can read
    (it tells where the store is); False when it already says that."""
    target = Path(path)
    text = "".join(f"{a}\n" for a in addresses)
    try:
        if target.read_text() == text:
            return False
    except OSError:
        pass
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
    partial.write_text(text)
    os.replace(partial, target)
    return True


def follow(config: CacheConfig, apply: Callable[[list[str]], object]) -> AddressFile | None:
    """A started `AddressFile` for `config.remote_addresses_file`, when it names one and the
    config has a remote tier; None otherwise."""
    if not config.remote_addresses_file or Tier.REMOTE not in config.lower_tiers:
        return None
    return AddressFile(config.remote_addresses_file, apply).start()


class AddressFile:
    """Follows `path`: calls `apply(addresses)` whenever what it lists changes (`apply` returns
    False where that moved nothing)."""

    def __init__(self, path: str | Path, apply: Callable[[list[str]], object], every_s: float = EVERY_S) -> None:
        self.path, self.apply, self.every_s = Path(path), apply, every_s
        self.changes = 0  # lists applied
        self.bad_reads = 0  # missing, empty or unparsable looks (the ring kept)
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) last read
        self._listed: list[str] | None = None
        self._said: str | None = None  # the last problem logged
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiered-cache-address-file", daemon=True)

    def start(self) -> AddressFile:
        self.check()
        self._thread.start()
        return self

    def check(self) -> bool:
        """Look once; True when a new list was applied."""
        try:
            stat = self.path.stat()
            seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if seen == self._seen:
                return False
            listed = read_addresses(self.path)
        except (OSError, ValueError) as exc:
            self.bad_reads += 1
            if str(exc) != self._said:
                self._said = str(exc)
                log.warning("tiered-cache: the store's address file is not usable, the ring stays as it is: %s", exc)
            return False
        self._seen, self._said = seen, None
        if listed == self._listed:
            return False
        self._listed = listed
        try:
            moved = self.apply(listed) is not False
        except Exception as exc:  # a cache closing under the thread
            log.warning("tiered-cache: cannot follow the store's address file: %s", exc)
            return False
        self.changes += moved
        return moved

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.every_s + 1)
