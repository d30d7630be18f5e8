"""`BlockTiers`: where the vLLM connector keeps blocks (vLLM-free).

A block is stored as one page per layer group (`layer_groups.py`): each page holds a run of the
block's layers, so a load can hand the first layers to the forward pass before the last arrive.
The pages follow a page spec: the model's, with `num_layers` the group's size.

A chain of blob tiers: a RAM blob tier (`host_capacity`) in front of the lower tiers a
`CacheConfig` names (disk, Redis, store servers). Saves are encoded and written on a bounded
background queue, to every tier at once (sharing with other instances is the point), so a
forward pass never waits for disk, Redis or gRPC; a full queue drops the save and counts it.
One `BlockTiers` per process and configuration: vLLM's scheduler-side and worker-side connectors in one
process (the usual single-GPU engine) share it, so the scheduler sees what the worker saved.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from tiered_cache.cache.address_file import follow as follow_address_file
from tiered_cache.cache.background import BACKGROUND_NICE, BackgroundQueue
from tiered_cache.cache.lower_tiers import build_lower_tiers
from tiered_cache.config import CacheConfig
from tiered_cache.device.malloc import tune_malloc
from tiered_cache.index.keys import PageKeyer
from tiered_cache.integrations.vllm.layer_groups import group_keys
from tiered_cache.model.spec import KVSpec
from tiered_cache.shm.arena_map import ArenaViews
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.ram import RamTier
from tiered_cache.tiers.readdress import readdress
from tiered_cache.wire.codec import BlobError, encode_page, page_view

log = logging.getLogger("tiered_cache.integrations.vllm")
_SHARED: dict[tuple[str, str, int], BlockTiers] = {}  # (fingerprint, config, layers per page)
_SHARED_LOCK = threading.Lock()
_MAX_PREFETCHES = 16  # loads started ahead and not yet taken (a request vLLM then did not load)
Pages = list[torch.Tensor | None]


class BlockTiers:
    def __init__(self, spec: KVSpec, config: CacheConfig, layers_per_page: int | None = None) -> None:
        """`spec`: one whole block (every layer); `layers_per_page`: layers in each stored page
        (default: all, one page a block)."""
        per_page = layers_per_page or spec.num_layers
        if per_page < 1 or spec.num_layers % per_page:
            raise ValueError(f"layers_per_page must divide the model's {spec.num_layers} layers, got {per_page}")
        self.block_spec = spec
        self.layers_per_page = per_page
        self.num_groups = spec.num_layers // per_page
        self.spec = spec if per_page == spec.num_layers else spec.with_options(num_layers=per_page)  # a page's
        self.config = config
        if config.malloc_tuning:
            tune_malloc()  # else every load pays first-touch page faults on fresh buffers
        tiers = [RamTier(config.host_capacity), *build_lower_tiers(config, self.spec.fingerprint)]
        self.chain = TierChain(tiers)
        self.writer = BackgroundQueue("vllm-block-saver", capacity=config.demotion_queue, nice=BACKGROUND_NICE)
        self._keyers: dict[str, PageKeyer] = {}
        self._lock = threading.Lock()
        # Store servers that move (a shard back on another port): the list a file keeps, read
        # before the channels are opened.
        self.address_file = follow_address_file(config, self.set_remote_addresses)
        # Channels to store servers open now, off the engine's start, not on the first load.
        threading.Thread(target=self._warm, name="vllm-block-tiers-warm", daemon=True).start()
        self.saves_dropped = 0  # blocks whose save was dropped: the queue was full
        self.load_errors = 0  # pages found but refused on decode (counted, then recomputed)
        self.load_failures = 0  # blocks a lookup promised that could not be loaded (vLLM recomputed them)
        self.lent_lost = 0  # pages lent from a server's arena and written over before copied: read again
        # Loads started when the scheduler found the blocks, taken by the worker's load job: set
        # once a worker registers its KV in this process (scheduler and worker share these tiers).
        self.loads_here = False
        self._prefetches: OrderedDict[tuple[bytes, ...], tuple[Future[list[Pages]], ArenaViews]] = OrderedDict()
        self._prefetcher: ThreadPoolExecutor | None = None
        self.prefetches_taken = 0
        # Hints that a request is on its way (`promote`): small, bounded, dropped when behind.
        self.promoter = BackgroundQueue("vllm-block-promoter", capacity=8, nice=BACKGROUND_NICE)
        self.promoted = 0  # blocks started toward this process ahead of their request
        self.promotes_dropped = 0

    def set_remote_addresses(self, addresses: Sequence[str]) -> bool:
        """Point the store tier at `addresses`: keys move to their new owners (a key whose owner
        changed reads as a miss until saved again). False when the ring is unchanged."""
        return readdress(self.chain, addresses) is not None

    @classmethod
    def shared(cls, spec: KVSpec, config: CacheConfig, layers_per_page: int | None = None) -> BlockTiers:
        key = (spec.fingerprint, repr(sorted(config.to_dict().items())), layers_per_page or spec.num_layers)
        with _SHARED_LOCK:
            tiers = _SHARED.get(key)
            if tiers is None:
                tiers = _SHARED[key] = cls(spec, config, layers_per_page)
            return tiers

    def _warm(self) -> None:
        for tier in self.chain.tiers:
            warm = getattr(tier, "warm", None)
            if warm is not None:
                try:
                    warm()
                except Exception as exc:  # its servers moved meanwhile: the first load opens them
                    log.debug("tiered-cache: warming %s failed: %s", type(tier).__name__, exc)

    def layers_of(self, group: int) -> range:
        """The model layers that group `group`'s pages hold."""
        return range(group * self.layers_per_page, (group + 1) * self.layers_per_page)

    def page_keys(self, block_keys: Sequence[bytes], group: int) -> list[bytes]:
        return group_keys(block_keys, self.num_groups, group)

    def all_page_keys(self, block_keys: Sequence[bytes]) -> list[bytes]:
        """Every page key of `block_keys`, block after block (group 0 .. n-1 of each)."""
        per_group = [self.page_keys(block_keys, g) for g in range(self.num_groups)]
        return [key for pages in zip(*per_group, strict=True) for key in pages]

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        """Block keys of the full blocks of `tokens` (a partial last block has none)."""
        with self._lock:
            keyer = self._keyers.get(namespace)
            if keyer is None:
                keyer = self._keyers[namespace] = PageKeyer(self.spec, namespace)
        return keyer.keys(np.asarray(tokens, dtype=np.int64))

    def keying(self, namespace: str) -> dict[str, Any]:
        """How `keys` and `all_page_keys` name pages, for a reader of the store's events (a
        router): the chain from `root_key(namespace, fingerprint)` over blocks of `page_size`
        tokens, each block's pages `group_keys(block keys, groups, g)`."""
        return {"fingerprint": self.spec.fingerprint, "namespace": namespace, "page_size": self.spec.page_size,
                "groups": self.num_groups}

    def leading(self, block_keys: Sequence[bytes]) -> int:
        """How many leading blocks the tiers hold whole (every layer group of each)."""
        where = self.chain.locate(self.all_page_keys(block_keys), leading=True)
        return next((i for i, w in enumerate(where) if w is None), len(where)) // self.num_groups

    def stored_below(self, block_key: bytes) -> bool:
        """Whether the last tier is known to hold every page of the block (no need to save it)."""
        last = len(self.chain.tiers) - 1
        return all(self.chain.known_in(k, last) for k in self.all_page_keys([block_key]))

    def load(self, block_keys: Sequence[bytes], group: int = 0, lease: ArenaViews | None = None
             ) -> list[torch.Tensor | None]:
        """Layer group `group` of each block: a page (layers_per_page, 2, heads, block_size, dim),
        or None when it is missing or refused on decode (the caller must not use that block). A
        raw page is a view into its blob: no copy. With `lease`, a page from a store server on
        this host may be a view into its arena: copy it, then drop the blocks whose page keys
        `lease.lost()` names (`ArenaViews`)."""
        shape = self.spec.staging_shape(1)[1:]
        keys = self.page_keys(block_keys, group)
        out: list[torch.Tensor | None] = []
        for key, blob in zip(keys, self.chain.get(keys, lease=lease), strict=True):
            if blob is None:
                out.append(None)
                continue
            try:
                flat = page_view(blob, self.spec, key, check_crc=False)  # the tier verified it
            except BlobError:
                self.load_errors += 1
                out.append(None)
                continue
            with warnings.catch_warnings():  # a read-only view: only ever read from
                warnings.simplefilter("ignore", UserWarning)
                out.append(torch.from_numpy(flat).view(self.spec.dtype.torch).view(shape))
        return out

    def prefetch(self, block_keys: Sequence[bytes]) -> bool:
        """Start loading every layer group of these blocks in the background, for the load job
        that follows in this process (`take_prefetch`): the load overlaps what the engine does
        between scheduling a request and its forward. Pages from a same-host store server are
        lent (`ArenaViews`): the job checks them after copying, as for its own loads. Only where a
        worker registered its KV here, and for whole blocks (loaded group by group, the first
        group must not wait for the last); False when not started."""
        key = tuple(block_keys)
        if not self.loads_here or not key or self.num_groups > 1:
            return False
        with self._lock:
            if key in self._prefetches:
                return True
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-block-prefetch")
            lease = ArenaViews()
            self._prefetches[key] = (self._prefetcher.submit(self._load_groups, list(key), lease), lease)
            while len(self._prefetches) > _MAX_PREFETCHES:
                self._prefetches.popitem(last=False)
        return True

    def promote(self, block_keys: Sequence[bytes]) -> int:
        """Start bringing the leading blocks of `block_keys` that the tiers hold toward this
        process before vLLM asks for them (a router's hint that a request is on its way): the
        load job's own prefetch when it can take one (`prefetch`), else a copy into the RAM tier
        on the background queue. Returns the blocks started; 0 when none are held (or the queue
        is full: counted in `promotes_dropped`)."""
        held = self.leading(block_keys)
        if not held:
            return 0
        keys = list(block_keys[:held])
        if self.prefetch(keys) or self.promoter.submit(self._promote, keys):
            self.promoted += held
            return held
        self.promotes_dropped += held
        return 0

    def _promote(self, block_keys: list[bytes]) -> None:
        keys = self.all_page_keys(block_keys)
        where = self.chain.locate(keys)
        below = [i for i, w in enumerate(where) if w]  # held, and not in the RAM tier already
        if below:
            self.chain.get([keys[i] for i in below], [where[i] for i in below], load=True)

    def _load_groups(self, block_keys: list[bytes], lease: ArenaViews) -> list[Pages]:
        return [self.load(block_keys, group, lease) for group in range(self.num_groups)]

    def take_prefetch(self, block_keys: Sequence[bytes]) -> tuple[Future[list[Pages]], ArenaViews] | None:
        """The background load `prefetch` started for exactly these blocks, if any (taken once)."""
        with self._lock:
            found = self._prefetches.pop(tuple(block_keys), None)
        self.prefetches_taken += found is not None
        return found

    def save(self, block_keys: Sequence[bytes], blocks: torch.Tensor, ready: Callable[[], None] | None = None) -> bool:
        """Queue `blocks` (n, layers, 2, heads, block_size, dim; a copy the caller no longer
        touches) to be split into layer-group pages, encoded and written below. `ready`: called
        before the blocks are read (a device's copy into them may still run)."""
        if not block_keys:
            return True
        if self.writer.submit(self._write, list(block_keys), blocks, ready):
            return True
        self.saves_dropped += len(block_keys)
        return False

    def flush(self, timeout_s: float | None = None) -> bool:
        return self.writer.flush(timeout_s)

    def _write(self, block_keys: list[bytes], blocks: torch.Tensor, ready: Callable[[], None] | None) -> None:
        cfg = self.config
        if ready is not None:
            ready()
        blocks = blocks.to(self.spec.dtype.torch).contiguous()
        items = []
        for group in range(self.num_groups):
            layers = self.layers_of(group)
            for key, block in zip(self.page_keys(block_keys, group), blocks, strict=True):
                page = block[layers.start:layers.stop]  # a contiguous run of a contiguous block
                items.append((key, encode_page(page, self.spec, key, cfg.codec, cfg.codec_min_saving)))
        for index in range(len(self.chain.tiers)):
            self.chain.put(items, index)
