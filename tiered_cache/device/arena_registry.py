"""Arena maps registered with CUDA: once per map in this process, whatever reads it.

The DMA from a same-host store's arena (arena_copy.py) needs its read-only map page-locked and
known to the driver (`cudaHostRegister`, read-only). A map is registered the first time any
copier asks (or as soon as it is mapped: `RegisterAhead`), and stays so until it is closed or
collected: two caches reading one store share the registration, and a map a client abandoned when
its server restarted (left to the garbage collector while a Get may still read it) is
unregistered when it goes, not kept page-locked by a copier that holds it.

What keeps a stale registration from ever being read (the DMA would read the old pages while the
CPU checks the new map's: wrong KV passing its checksum):
- The registry holds the map's memory (the `mmap` object) from registration to unregistration, so
  the range cannot be unmapped, and its address reused by another map, while it is registered.
- Maps are known by `id()`, which a new map may take once an old one is collected, before the
  old one's unregistration has run: the new map's first ask undoes the old registration there
  and then, and the old one's queued release, finding another map's entry, leaves it alone.
- The callback of a collected map only queues its release (`later`: a `SimpleQueue`, safe to
  call from inside a garbage collection, which may run while any lock of the thread is held).
- `close()` unregisters before it unmaps (its callback is added before the registration, and a
  map already closing is not registered at all). A map collected unclosed is unregistered on the
  registry's own thread (never inside a garbage collection on an engine's thread, which could
  fall in a CUDA graph capture), its memory held until then.
- A range the driver says is registered already, by someone else or by a registration that
  outlived its map, is not trusted: the pages are staged.
A refusal is remembered for the map and asked again only after `RETRY_REFUSED_S` (one that may
pass, such as pinned memory running out), so loads from a map the driver will not take do not
each try to pin the whole arena again.
Every call runs with the pool's device current, so no other GPU gets a context. A failed runtime
call leaves its error as the thread's last error, which torch's next kernel launch check would
raise for an unrelated op; it is read off at once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from tiered_cache.shm.arena_map import ArenaMap, watch_maps

log = logging.getLogger("tiered_cache.device.arena_registry")

_READ_ONLY = 0x08 | 0x01  # cudaHostRegisterReadOnly | cudaHostRegisterPortable
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
RETRY_REFUSED_S = 60.0  # a map the driver refused is asked again after this long


class ArenaRegistry:
    """Which maps are registered. `register(address, size) -> error`, `unregister(address) ->
    error` and `forget_error()` are the runtime's; `later(fn)` runs `fn` on the registry's thread;
    `clock()`: seconds, for when a refused map is asked again."""

    def __init__(self, register: Callable[[int, int], int], unregister: Callable[[int], int],
                 forget_error: Callable[[], None] = lambda: None,
                 later: Callable[[Callable[[], None]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._register, self._unregister, self._forget_error = register, unregister, forget_error
        self.later = later or (lambda fn: fn())  # where work off the caller's thread runs
        self._clock = clock
        self._lock = threading.RLock()
        # id(map) -> (a weak reference to it, its address, its memory: held while registered)
        self._held: dict[int, tuple[weakref.ref[ArenaMap], int, Any]] = {}
        # id(map) -> (a weak reference to it, the runtime's error, when to ask again)
        self._refused: dict[int, tuple[weakref.ref[ArenaMap], int, float]] = {}

    def ensure(self, arena: ArenaMap) -> int:
        """0 once `arena`'s map is registered (now or before), else the runtime's error (the one
        remembered, within `RETRY_REFUSED_S` of a refusal; -1 for a map closing already); then
        nothing is registered and the caller stages its pages."""
        key = self._key(arena)
        with self._lock:
            entry = self._held.get(key)
            if entry is not None and entry[0]() is arena:
                return 0
            if entry is not None:  # a collected map's, its release still queued: undone here, first
                self._release(key, entry[0])
            refused = self._refused.get(key)
            if refused is not None and refused[0]() is arena:
                if self._clock() < refused[2]:
                    return refused[1]
                if arena.closed:  # its close() callback is in place since the first ask
                    return -1
            elif not arena.on_close(lambda _: self._release(key)):  # first: close() then waits for us
                return -1
            address = arena.address()
            err = self._register(address, arena.size)
            if err:
                self._forget_error()  # ALREADY_REGISTERED too: not ours to trust (module doc)
                self._refused[key] = (weakref.ref(arena, lambda ref: self._forget_refusal(key, ref)), err,
                                      self._clock() + RETRY_REFUSED_S)
                return err
            self._refused.pop(key, None)
            self._held[key] = (weakref.ref(arena, lambda ref: self.later(lambda: self._release(key, ref))),
                               address, arena.raw)
            return 0

    def _forget_refusal(self, key: int, ref: weakref.ref[ArenaMap]) -> None:
        """A refused map was collected: its entry goes, unless another map has the key now (no
        lock: this runs inside a garbage collection; a lost race costs one more ask at most)."""
        entry = self._refused.get(key)
        if entry is not None and entry[0] is ref:
            self._refused.pop(key, None)

    _key = staticmethod(id)  # what a map is known by (tests give two maps one key, as id() reuse does)

    def held(self, arena: ArenaMap) -> bool:
        with self._lock:
            entry = self._held.get(self._key(arena))
            return entry is not None and entry[0]() is arena and not arena.closed

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _release(self, key: int, ref: weakref.ref[ArenaMap] | None = None) -> None:
        """Unregister the map known by `key`: the one closing (`ref` None: it is alive, so the key
        is its own), or the collected one `ref` referred to, unless another map has the key now."""
        with self._lock:
            entry = self._held.get(key)
            if ref is None:
                self._refused.pop(key, None)
            elif entry is None or entry[0] is not ref:
                return  # undone already, when a new map with this key first asked
            if entry is None:
                return
            del self._held[key]
            if self._unregister(entry[1]):
                self._forget_error()
            # entry[2], the map's memory, goes with the entry: unmapped when its last holder lets go


class RegisterAhead:
    """Registers each arena map of this process as it is mapped (and those mapped already), on the
    registry's thread, so that the first load from a same-host store does not pin a whole arena
    (about a second for ten GiB) inside its TTFT. A load that comes first waits for it (the
    registry's lock) or registers the map itself."""

    def __init__(self, registry: ArenaRegistry) -> None:
        self.registry = registry
        self._closed = False
        self._stop = watch_maps(self._soon)

    def _soon(self, arena: ArenaMap) -> None:
        ref = weakref.ref(arena)  # a map dropped before its turn is not kept for it

        def register() -> None:
            if not self._closed and (still := ref()) is not None and not still.closed:
                self.registry.ensure(still)  # a refusal: the load that needs the map says so

        self.registry.later(register)

    def close(self) -> None:
        self._closed = True
        self._stop()


def _cuda_registry(device: Any) -> ArenaRegistry:
    import torch

    cudart = torch.cuda.cudart()
    work: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def serve() -> None:  # the registry's thread: registrations ahead, releases of collected maps
        torch.cuda.set_device(device)
        while True:
            fn = work.get()
            try:
                fn()
            except Exception:  # one failed release or registration must not end the thread
                log.exception("arena registry: a queued call failed")

    threading.Thread(target=serve, name="tiered-cache-arena-register", daemon=True).start()

    def on_device(call: Callable[[], int]) -> int:
        with torch.cuda.device(device):
            return call()

    return ArenaRegistry(
        lambda address, size: on_device(lambda: int(cudart.cudaHostRegister(address, size, _READ_ONLY))),
        lambda address: on_device(lambda: int(cudart.cudaHostUnregister(address))),
        lambda: forget_cuda_error(device), work.put)


def forget_cuda_error(device: Any) -> None:
    """Clear the error a refused CUDA runtime call left behind. Torch binds no cudaGetLastError:
    one tiny kernel launch has torch's launch check read it (and so clear it), raising it here,
    where it is expected, instead of in the next op."""
    import torch

    with torch.cuda.device(device), contextlib.suppress(RuntimeError):
        torch.zeros(1, device=device)


_CUDA: ArenaRegistry | None = None
_CUDA_LOCK = threading.Lock()


def cuda_registry(device: Any) -> ArenaRegistry:
    """The process's registry of arena maps with the CUDA runtime torch uses, its calls made with
    the first caller's `device` current (a map registered Portable serves every device)."""
    global _CUDA
    with _CUDA_LOCK:
        if _CUDA is None:
            _CUDA = _cuda_registry(device)
        return _CUDA


def error_name(err: int) -> str:
    """The CUDA runtime's words for `err`, or '?' where this torch does not bind them."""
    try:
        import torch

        cudart = torch.cuda.cudart()
        return str(cudart.cudaGetErrorString(cudart.cudaError(err)))
    except Exception:  # only a log line's detail
        return "?"
