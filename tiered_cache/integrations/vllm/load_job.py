"""`LoadJob`: one forward step's block loads, layer group after layer group (vLLM-free).

`run` (on the connector's loader thread, or inline) gets group 0 of every block, copies it
into vLLM's KV and signals it, then group 1, and so on. The forward pass waits for a layer's
group (`wait_for`) before that layer attends. Whatever goes wrong ends as failed blocks, which
vLLM recomputes, never as a hang or as KV copied in after it was used:
- a block missing or refused in any group is failed;
- a wait past `wait_s` cancels the job: nothing is copied in afterwards (vLLM may hand the
  blocks to another request once the step ends) and every block of the job is failed;
- a layer that attended without waiting may have read KV not yet there: `finish` names it, and
  every block of the job is failed.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence

import torch

from tiered_cache.integrations.vllm.block_copy import BlockCopier
from tiered_cache.integrations.vllm.block_tiers import BlockTiers
from tiered_cache.shm.arena_map import ArenaViews

log = logging.getLogger(__name__)
WAIT_S = 120.0  # the tiers' own deadlines end a stuck get long before this


class LoadJob:
    def __init__(self, tiers: BlockTiers, copier: BlockCopier,
                 transfers: Sequence[tuple[Sequence[bytes], Sequence[int]]], timing: bool = False,
                 wait_s: float = WAIT_S) -> None:
        """`transfers`: (block keys, vLLM block ids) pairs; `copier`: into vLLM's KV (`block_copy`)."""
        self.tiers, self.copier = tiers, copier
        self._after = copier.mark()  # the engine's work so far: copies in follow it (a device's stream)
        self.transfers = [(list(keys), list(ids)) for keys, ids in transfers]
        self.timing, self.wait_s = timing, wait_s
        self.ready = [threading.Event() for _ in range(tiers.num_groups)]
        self.done = threading.Event()
        self.failed: set[int] = set()
        self._lock = threading.Lock()  # held while copying in, and to cancel
        self._cancelled = False
        self._waited: set[str] = set()
        self.waited_s = 0.0  # the engine's time blocked on this job: its waits, and `run` inline
        # Loads the scheduler started ahead for exactly these blocks (BlockTiers.prefetch).
        self._prefetched = [tiers.take_prefetch(keys) for keys, _ in self.transfers]

    @property
    def block_ids(self) -> set[int]:
        return {b for _, ids in self.transfers for b in ids}

    def run_inline(self) -> None:
        """`run` on the engine's own thread: all of it is time the engine waited."""
        started = time.perf_counter()
        self.run()
        self.waited_s += time.perf_counter() - started

    def run(self) -> None:
        start = time.perf_counter()
        try:
            with torch.inference_mode():  # vLLM's KV tensors are inference tensors
                for group in range(self.tiers.num_groups):
                    self._load_group(group)
                    self.ready[group].set()
                    if self.timing:
                        print(f"[tiered-cache] layer group {group} in at {1e3 * (time.perf_counter() - start):.1f} ms",
                              file=sys.stderr, flush=True)
        except Exception:
            log.exception("tiered-cache: loading blocks failed; vLLM recomputes them")
            self._cancel()
        finally:
            for event in self.ready:
                event.set()
            self.done.set()

    def _load_group(self, group: int) -> None:
        for (keys, block_ids), prefetched in zip(self.transfers, self._prefetched, strict=True):
            started = time.perf_counter()
            # Pages from a store server on this host come as views into its arena (no copy out):
            # copied into vLLM's KV, then checked; any the arena wrote over are read again
            # as copies before the group is signalled, so no layer ever attends to them.
            lease, pages = ArenaViews(), None
            if prefetched is not None:
                try:
                    pages, lease = prefetched[0].result()[group], prefetched[1]
                except Exception:  # loaded again below, as if never started
                    log.warning("tiered-cache: a load started ahead failed; loading again", exc_info=True)
            copied, failed = self._copy_in(keys, block_ids, group, lease, pages)
            page_keys = self.tiers.page_keys(keys, group)
            lost = lease.lost().intersection(page_keys)  # a prefetch's lease holds every group's pages
            if lost:
                self.tiers.lent_lost += len(lost)
                again = [i for i, key in enumerate(page_keys) if key in lost]
                recopied, _ = self._copy_in([keys[i] for i in again], [block_ids[i] for i in again], group,
                                            None)
                failed = (failed - recopied) | ({block_ids[i] for i in again} - recopied)
            with self._lock:
                self.failed.update(failed)
            if self.timing:
                print(f"[tiered-cache]   group {group}: {len(keys)} blocks in "
                      f"{1e3 * (time.perf_counter() - started):.1f} ms ({len(copied)} copied, {len(lost)} pages "
                      "written over and read again)", file=sys.stderr, flush=True)

    def _copy_in(self, keys: list[bytes], block_ids: list[int], group: int,
                 lease: ArenaViews | None, pages: list[torch.Tensor | None] | None = None) -> tuple[set[int], set[int]]:
        """Load group `group` of these blocks (unless prefetched: `pages`) and copy it into
        vLLM's KV. Returns the block ids copied in and those missing or refused."""
        if not keys:
            return set(), set()
        if pages is None:
            pages = self.tiers.load(keys, group, lease)
        good = [i for i, page in enumerate(pages) if page is not None]
        with self._lock:
            if self._cancelled:
                return set(), set()
            self.copier.scatter([block_ids[i] for i in good], [pages[i] for i in good], self.tiers.layers_of(group),
                                self._after)
        return {block_ids[i] for i in good}, {block_ids[i] for i, page in enumerate(pages) if page is None}

    def wait_for(self, group: int, layer_name: str) -> None:
        """Block until group `group` is copied in (or the job gave up on it)."""
        self._waited.add(layer_name)
        started = time.perf_counter()
        ready = self.ready[group].wait(self.wait_s)
        self.waited_s += time.perf_counter() - started
        if not ready:
            log.warning("tiered-cache: layer group %d not loaded within %.3g s; vLLM recomputes its blocks",
                        group, self.wait_s)
            self._cancel()

    def finish(self, expected_layers: set[str]) -> int:
        """Wait for the job to end (or cancel it). Returns how many of `expected_layers` attended
        without waiting; their job's blocks are all failed then."""
        started = time.perf_counter()
        done = self.done.wait(self.wait_s)
        self.waited_s += time.perf_counter() - started
        if not done:
            self._cancel()
        unwaited = len(expected_layers - self._waited)
        if unwaited:
            self._cancel()
        return unwaited

    def _cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            self.failed.update(self.block_ids)
