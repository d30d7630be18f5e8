"""`HookTimer`: the wall time a vLLM process spends inside a KV connector's hooks (vLLM-free).

`bench vllm` reports it beside TTFT: a connector controls its lookup, its loads and its saves, not
the forward pass, which is the same compute for every way and, on a small shared CPU machine,
varies more between two processes than the connectors differ. Time in the hooks is measured the
same way for any connector class, ours or vLLM's `ExampleConnector`; work a connector leaves to
its own threads is not in it (it shows in TTFT, if anywhere).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

# What vLLM calls on a V1 connector in the scheduler and in the worker, per step or per request.
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "start_load_kv", "wait_for_layer_load",
         "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors")


class HookTimer:
    """Wraps `HOOKS` of a connector class (`install`); `take()` returns the seconds spent in them
    since the last `take()`, and resets. A hook called from inside another is counted once."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._calls = 0
        self._depth = threading.local()
        self._lock = threading.Lock()

    def install(self, cls: type) -> None:
        """Wrap the hooks `cls` itself defines (an inherited default is left alone: vLLM may ask
        whether a connector overrides one)."""
        for name in HOOKS:
            hook = cls.__dict__.get(name)
            if callable(hook) and not getattr(hook, "_timed", False):
                setattr(cls, name, self._timed(hook))

    def _timed(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            started = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    with self._lock:
                        self._seconds += time.perf_counter() - started
                        self._calls += 1

        timed._timed = True  # type: ignore[attr-defined]
        return timed

    def take(self) -> tuple[float, int]:
        """(seconds inside the hooks, hook calls) since the last take."""
        with self._lock:
            out = (self._seconds, self._calls)
            self._seconds, self._calls = 0.0, 0
        return out
