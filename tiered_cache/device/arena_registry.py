"""Arena maps registered with CUDA: once per map in this process, whatever reads it.

The DMA from a same-host store's arena (arena_copy.py) needs its read-only map page-locked and
known to the driver (`cudaHostRegister`, read-only). A map is registered the first time any
copier asks, and stays so until it is closed or collected: two caches reading one store share
the registration (a second `cudaHostRegister` of the range would be refused), and a map a client
abandoned when its server restarted (left to the garbage collector while a Get may still read it)
is unregistered when it goes, not kept page-locked by a copier that holds it.

A registration runs before the map can be unmapped: the weak reference's callback runs while the
map object is still whole. A failed runtime call leaves its error as the thread's last error,
which torch's next kernel launch check would raise for an unrelated op; it is read off at once.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable

from tiered_cache.shm.arena_map import ArenaMap

_READ_ONLY = 0x08 | 0x01  # cudaHostRegisterReadOnly | cudaHostRegisterPortable
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered: someone else's registration


class ArenaRegistry:
    """Which maps are registered; `register` and `unregister` are the runtime's calls (address,
    size) -> error and (address) -> error, `forget_error` reads off a failed call's error."""

    def __init__(self, register: Callable[[int, int], int], unregister: Callable[[int], int],
                 forget_error: Callable[[], None] = lambda: None) -> None:
        self._register, self._unregister, self._forget_error = register, unregister, forget_error
        self._lock = threading.RLock()  # a collected map's callback may run inside `ensure`
        self._held: dict[int, weakref.finalize] = {}  # address of a live map -> its unregistration

    def ensure(self, arena: ArenaMap) -> int:
        """0 once `arena`'s map is registered (now, or already, by this registry or by someone
        else), else the runtime's error; then nothing is registered and the caller stages."""
        address = arena.address()
        with self._lock:
            if address in self._held:
                return 0
            err = self._register(address, arena.size)
            if err == ALREADY_REGISTERED:  # another library's registration: usable, not ours to undo
                self._forget_error()
                return 0
            if err:
                self._forget_error()
                return err
            release = weakref.finalize(arena, self._release, address)
            release.atexit = False  # at exit the driver may be gone; the process's end unpins
            self._held[address] = release
        arena.on_close(lambda _: release())  # before the map is unmapped
        return 0

    def held(self, arena: ArenaMap) -> bool:
        with self._lock:
            return arena.address() in self._held

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _release(self, address: int) -> None:
        with self._lock:
            if self._held.pop(address, None) is None:
                return
            if self._unregister(address):
                self._forget_error()


def _cuda_registry() -> ArenaRegistry:
    import torch

    cudart = torch.cuda.cudart()

    def forget_error() -> None:
        # Torch binds no cudaGetLastError: one tiny kernel launch has torch's launch check read it
        # (and so clear it), raising it here, where it is expected, instead of in the next op.
        with contextlib.suppress(RuntimeError):
            torch.zeros(1, device="cuda")

    return ArenaRegistry(lambda address, size: int(cudart.cudaHostRegister(address, size, _READ_ONLY)),
                         lambda address: int(cudart.cudaHostUnregister(address)), forget_error)


_CUDA: ArenaRegistry | None = None
_CUDA_LOCK = threading.Lock()


def cuda_registry() -> ArenaRegistry:
    """The process's registry of arena maps with the CUDA runtime torch uses."""
    global _CUDA
    with _CUDA_LOCK:
        if _CUDA is None:
            _CUDA = _cuda_registry()
        return _CUDA


class RegisterAhead:
    """Registers each arena map of this process as it is mapped (and those mapped already), on a
    thread of its own, so that the first load from a same-host store does not pin a whole arena
    (about a second for ten GiB) inside its TTFT. A load that comes first waits for it (the
    registry's lock) or registers the map itself."""

    def __init__(self, registry: ArenaRegistry) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from tiered_cache.shm.arena_map import watch_maps

        self.registry = registry
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tiered-cache-arena-register")
        self._stop = watch_maps(self._soon)

    def _soon(self, arena: ArenaMap) -> None:
        ref = weakref.ref(arena)  # a map dropped before its turn is not kept for it

        def register() -> None:
            if (still := ref()) is not None and not still.closed:
                self.registry.ensure(still)  # a refusal: the load that needs the map says so

        with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing more to register
            self._thread.submit(register)

    def close(self) -> None:
        self._stop()
        self._thread.shutdown(wait=True, cancel_futures=True)


def error_name(err: int) -> str:
    """The CUDA runtime's words for `err`, or '?' where this torch does not bind them."""
    try:
        import torch

        cudart = torch.cuda.cudart()
        return str(cudart.cudaGetErrorString(cudart.cudaError(err)))
    except Exception:  # only a log line's detail
        return "?"

