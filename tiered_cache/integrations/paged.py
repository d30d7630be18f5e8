"""A transformers causal LM decoding straight from a `TieredCache` handle's pages.

`PagedSequence` is one request as an engine runs it on our page pool: every forward writes the
new tokens' K/V into the handle's pages (`writable_slots`, so copy-on-write forks stay apart) and
attention reads the live tokens' K/V back from the pages (`live_slots`), through a transformers
`Cache` whose layers do exactly that. On top of it the three engine features of the cache:

- `fork(n)`: copy-on-write children for parallel sampling or beam search (`TieredCache.fork`);
- `swap_out()` / `swap_in()`: preemption, the private pages parked in host RAM meanwhile;
- a retention `policy` (`SinkWindow`, `HeavyHitter`): after each forward the policy's dropped
  tokens leave the sequence and pages with no live token are freed (`TieredCache.drop_tokens`).
  Positions are handled as StreamingLLM does: a token's position is its index among the live
  tokens, not in the original text. Keys are stored rotated at the position they had when
  written; when tokens before them are dropped, attention reads them re-rotated to their
  position now (RoPE rotations add up, so one rotation by the difference), computed on the
  gathered copy: nothing cached is rewritten, no rounding piles up, and while nothing was
  dropped the keys are read unchanged (bit-exact with plain generation).

Batch size 1, NHD pages, rotary (RoPE) models with plain or llama3/linear-scaled frequencies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiered_cache.cache import TieredCache
from tiered_cache.cache.handle import CacheHandle
from tiered_cache.device.pool import device_index
from tiered_cache.integrations.paged_attention import attention_received, paged_cache, rotary_inv_freq, rotate_half
from tiered_cache.integrations.transformers import cache_keyword, last_logits_only, upload_tokens
from tiered_cache.model.spec import Layout


class PagedSequence:
    """One sequence of `model` whose KV lives in `handle`'s pages of `cache` (see the module doc).

    Make one with `PagedSequence.start` (matches and reuses a cached prefix of the prompt, runs
    the rest, commits the prompt's full pages) or around a handle you already hold.
    """

    def __init__(self, cache: TieredCache, handle: CacheHandle, model: Any, policy: Any = None,
                 next_position: int | None = None) -> None:
        if cache.spec.layout is not Layout.NHD:
            raise ValueError("PagedSequence reads NHD pages; build the spec with layout=NHD")
        self.cache, self.handle, self.model, self.policy = cache, handle, model, policy
        live = len(cache.live_slots(handle))
        self.positions = np.arange(live, dtype=np.int64)  # each live token's position in the text
        self.rotated = np.arange(live, dtype=np.int64)  # the position its key was rotated at
        self.scores = np.zeros(live)  # accumulated attention (HeavyHitter)
        self.next_position = live if next_position is None else next_position
        self._past = live  # live tokens before the forward under way: what attention's mask counts
        self._read: torch.Tensor | None = None
        self._write: torch.Tensor | None = None
        self._rotation: tuple[torch.Tensor, torch.Tensor] | None = None
        self.hf_cache = paged_cache(self, cache.spec.num_layers)

    @classmethod
    def start(cls, cache: TieredCache, model: Any, prompt: Sequence[int], policy: Any = None,
              namespace: str | None = None, commit: bool = True) -> tuple[PagedSequence, torch.Tensor]:
        """Run `prompt` (reusing its cached prefix; at least its last token is computed) and return
        the sequence and the next-token logits. With `commit`, the prompt's full pages are cached
        for other requests (and forks share them through the tree)."""
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("PagedSequence.start() needs a non-empty prompt")
        handle = cache.match(ids[:-1], namespace)
        try:
            cache.load(handle)
            sequence = cls(cache, handle, model, policy)
            logits = sequence.forward(ids[handle.prefix_tokens:], commit_as=ids if commit else None)
        except BaseException:
            cache.release(handle)
            raise
        return sequence, logits

    @property
    def num_live(self) -> int:
        return len(self.positions)

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], commit_as: Sequence[int] | None = None) -> torch.Tensor:
        """Run `token_ids` after the sequence, their K/V written into its pages; returns the last
        token's next-token logits (float32). `commit_as`, the whole text so far, commits its full
        pages afterwards (only when no policy dropped anything)."""
        n = len(token_ids)
        if not n:
            raise ValueError("forward() needs at least one token")
        cache, handle = self.cache, self.handle
        room = handle.own_tokens - handle.own_written
        if n > room:
            cache.allocate(handle, n - room)
        step = cache.writable_slots(handle, n)
        live = cache.live_slots(handle)
        self._past = len(live)
        # Uploaded without the host waiting for the stream: a load's copies may still be running.
        self._write = device_index(step, cache.pool.device)
        self._read = device_index(np.concatenate([live, step]), cache.pool.device)
        self._rotation = self._re_rotation()
        needs_scores = getattr(self.policy, "needs_scores", False)
        device = getattr(self.model, "device", None)
        positions = torch.arange(self._past, self._past + n, device=device)[None]
        try:
            cache_arg = {cache_keyword(self.model): self.hf_cache}
            out = self.model(upload_tokens([list(token_ids)], device), position_ids=positions, use_cache=True,
                             output_attentions=needs_scores, **cache_arg, **last_logits_only(self.model))
        finally:
            self._read = self._write = self._rotation = None
        cache.mark_written(handle, n)
        self.positions = np.concatenate([self.positions, np.arange(self.next_position, self.next_position + n)])
        self.rotated = np.concatenate([self.rotated, np.arange(self._past, self._past + n)])
        self.scores = np.concatenate([self.scores, np.zeros(n)])
        self.next_position += n
        if needs_scores:
            self.scores += attention_received(out.attentions)
        if self.policy is not None:
            self._apply_policy()
        elif commit_as is not None:
            cache.commit(handle, list(commit_as)[:handle.written_tokens])
        self._past = self.num_live
        return out.logits[0, -1].float()

    def _apply_policy(self) -> None:
        drop = self.policy.to_drop(self.positions, self.handle.prefix_tokens, self.scores)
        if drop.size:
            self.cache.drop_tokens(self.handle, drop)
            self.positions, self.rotated, self.scores = (np.delete(a, drop) for a in
                                                         (self.positions, self.rotated, self.scores))

    def _re_rotation(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin turning each live key from the position it was rotated at to its index now
        (None when every key is where it was written: the usual case, read as stored)."""
        shift = np.arange(self._past) - self.rotated
        if not shift.any():
            return None
        inv_freq = rotary_inv_freq(self.model)
        angles = torch.from_numpy(shift).to(inv_freq.device, torch.float32)[:, None] * inv_freq[None, :].float()
        emb = torch.cat([angles, angles], dim=-1)  # (past, head_dim), as the model's rotary embedding
        return emb.cos(), emb.sin()

    # --- what the transformers Cache layers call ---------------------------------------------------
    def update_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's K/V of `layer` (1, heads, n, dim) into the pages; return the layer's
        K/V over all live tokens then these, (1, heads, past + n, dim), in the model's dtype."""
        assert self._read is not None and self._write is not None, "update_layer() outside forward()"
        pool = self.cache.pool.kv
        k_flat = pool[0, layer].view(-1, *pool.shape[-2:])  # (pages * page_size, heads, dim)
        v_flat = pool[1, layer].view(-1, *pool.shape[-2:])
        k_flat[self._write] = keys[0].transpose(0, 1).to(pool.dtype)
        v_flat[self._write] = values[0].transpose(0, 1).to(pool.dtype)
        k_all = k_flat[self._read].transpose(0, 1).unsqueeze(0).to(keys.dtype)
        v_all = v_flat[self._read].transpose(0, 1).unsqueeze(0).to(values.dtype)
        if self._rotation is not None:
            cos, sin = (t.to(k_all.device, k_all.dtype) for t in self._rotation)
            past = k_all[:, :, :self._past]
            k_all = torch.cat([past * cos + rotate_half(past) * sin, k_all[:, :, self._past:]], dim=2)
        return k_all, v_all

    # --- the cache's engine features, for this sequence ---------------------------------------------
    def fork(self, n: int) -> list[PagedSequence]:
        """`n` copy-on-write children continuing this sequence (parallel samples, beams)."""
        children = []
        for handle in self.cache.fork(self.handle, n):
            child = PagedSequence(self.cache, handle, self.model, self.policy, self.next_position)
            child.positions, child.rotated = self.positions.copy(), self.rotated.copy()
            child.scores = self.scores.copy()
            children.append(child)
        return children

    def swap_out(self) -> int:
        return self.cache.swap_out(self.handle)

    def swap_in(self) -> np.ndarray:
        return self.cache.swap_in(self.handle)

    def release(self) -> None:
        self.cache.release(self.handle)


def sample_next(logits: torch.Tensor, generator: torch.Generator | None = None, temperature: float = 1.0) -> int:
    """A token drawn from softmax(logits / temperature) with `generator` (greedy at temperature 0)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def decode(sequence: PagedSequence, logits: torch.Tensor, max_new_tokens: int,
           generator: torch.Generator | None = None, temperature: float = 0.0,
           eos_token_id: int | None = None) -> list[int]:
    """Up to `max_new_tokens` tokens after `logits` (greedy, or sampled with `generator`)."""
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        tokens.append(sample_next(logits, generator, temperature))
        if tokens[-1] == eos_token_id or len(tokens) == max_new_tokens:
            break
        logits = sequence.forward([tokens[-1]])
    return tokens
