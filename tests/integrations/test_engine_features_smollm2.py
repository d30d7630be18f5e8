"""The engine features on the real model (SmolLM2-135M, fp32 pages): the model decodes straight
from the pool's pages (`PagedSequence`), and forks, swaps and retention must leave its tokens
exactly as they would be without them."""

from __future__ import annotations

import pytest
import torch

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.errors import SwapError
from tiered_cache.integrations import document, smollm2
from tiered_cache.integrations.paged import PagedSequence, decode
from tiered_cache.integrations.transformers import generate, spec_for
from tiered_cache.retention import HeavyHitter, SinkWindow

pytestmark = pytest.mark.slow
PAGE = 16


@pytest.fixture(scope="module")
def model_and_prompt():
    model, tokenizer = smollm2.load_model()
    prompt = document.chat_prompt(tokenizer, "Who keeps the light?", document.document()[:600])
    return model, prompt


def new_cache(model, pages: int = 96, host_pages: int = 32) -> TieredCache:
    spec = spec_for(model, dtype="fp32", page_size=PAGE)
    cfg = CacheConfig(pool_capacity=pages * spec.bytes_per_page, host_capacity=host_pages * spec.bytes_per_page,
                      malloc_tuning=False)
    return TieredCache(spec, cfg, lower=[])


def test_paged_decoding_equals_plain_generation(model_and_prompt):
    model, prompt = model_and_prompt
    plain = generate(model, prompt, None, max_new_tokens=12)
    with new_cache(model) as cache:
        sequence, logits = PagedSequence.start(cache, model, prompt)
        assert torch.equal(logits, plain.first_logits)
        assert decode(sequence, logits, 12) == plain.tokens
        sequence.release()
        cache.check_integrity()


def test_four_forked_samples_equal_four_unshared_ones_while_the_prompt_is_held_once(model_and_prompt):
    model, prompt = model_and_prompt
    seeds, steps = [11, 12, 13, 14], 10
    prompt_pages = -(-len(prompt) // PAGE)
    unshared = []
    for seed in seeds:  # each sample on its own, in its own cache: nothing shared
        with new_cache(model) as cache:
            sequence, logits = PagedSequence.start(cache, model, prompt, commit=False)
            unshared.append(decode(sequence, logits, steps, torch.Generator().manual_seed(seed), temperature=1.0))
            sequence.release()
    assert len({tuple(t) for t in unshared}) > 1  # sampling really differs between seeds

    with new_cache(model) as cache:
        parent, logits = PagedSequence.start(cache, model, prompt)
        forks = parent.fork(len(seeds))
        pool = cache.stats().pool
        assert pool.used_pages == prompt_pages  # the prompt's pages, held once by five sequences:
        assert cache.stats().protected_pages == len(prompt) // PAGE  # full ones in the tree, locked by each
        assert pool.shared_pages == (1 if len(prompt) % PAGE else 0) and pool.forks == len(seeds)  # + the last
        forked = [decode(fork, logits, steps, torch.Generator().manual_seed(seed), temperature=1.0)
                  for fork, seed in zip(forks, seeds, strict=True)]
        assert forked == unshared
        decode_pages = -(-(steps - 1) // PAGE) + 1  # each fork's new tokens, plus its copied last page
        assert cache.stats().pool.used_pages <= prompt_pages + len(seeds) * decode_pages
        assert cache.stats().pool.cow_copies <= len(seeds)  # at most one copied page per fork
        cache.check_integrity()
        for s in (parent, *forks):
            s.release()
        cache.check_integrity()


def test_a_request_swapped_out_mid_decode_continues_with_the_same_tokens(model_and_prompt):
    model, prompt = model_and_prompt
    with new_cache(model) as cache:
        sequence, logits = PagedSequence.start(cache, model, prompt, commit=False)
        expected = decode(sequence, logits, 16)
        sequence.release()

    with new_cache(model, pages=64, host_pages=48) as cache:
        sequence, logits = PagedSequence.start(cache, model, prompt, commit=False)
        tokens = decode(sequence, logits, 6)
        own_before = list(sequence.handle.own_pages)
        moved = sequence.swap_out()
        assert moved == len(own_before) and cache.stats().pool.used_pages == 0  # holds no device page
        assert cache.stats().pool.swapped_pages == moved
        # Another request takes the device pages meanwhile, so swap_in loads them into other device pages.
        other, other_logits = PagedSequence.start(cache, model, prompt[:40], commit=False)
        decode(other, other_logits, 4)
        sequence.swap_in()
        assert sequence.handle.own_pages != own_before
        logits = sequence.forward([tokens[-1]])
        tokens += decode(sequence, logits, 10)
        assert tokens == expected
        assert cache.stats().pool.swapped_pages == 0
        for s in (sequence, other):
            s.release()
        cache.check_integrity()


def test_swap_out_into_full_host_ram_fails_cleanly_with_the_pool_intact(model_and_prompt):
    model, prompt = model_and_prompt
    with new_cache(model, host_pages=2) as cache:
        sequence, logits = PagedSequence.start(cache, model, prompt, commit=False)
        pages, used = list(sequence.handle.own_pages), cache.stats().pool.used_pages
        with pytest.raises(SwapError, match="host RAM cannot hold"):
            sequence.swap_out()
        assert sequence.handle.own_pages == pages and cache.stats().pool.used_pages == used
        assert cache.stats().pool.swapped_pages == 0
        plain = generate(model, prompt, None, max_new_tokens=6)
        assert decode(sequence, logits, 6) == plain.tokens  # it carries on, its KV untouched
        sequence.release()
        cache.check_integrity()


def test_sink_window_keeps_memory_flat_over_four_windows(model_and_prompt):
    model, prompt = model_and_prompt
    window = 24  # not a whole number of pages: the window's last page is partly filled
    with new_cache(model) as cache:
        sequence, logits = PagedSequence.start(cache, model, prompt[:24], policy=SinkWindow(4, window))
        used = []
        for _ in range(4 * window):
            logits = sequence.forward([int(logits.argmax())])
            used.append(cache.stats().pool.used_pages)
            assert sequence.num_live <= 4 + window
        bound = 1 + -(-window // PAGE) + 1  # the sink's page, the window's pages, one partly filled
        assert max(used) <= bound and max(used[window:]) == max(used[-window:])  # flat, not growing
        assert sequence.handle.compacted and cache.stats().pool.compacted_pages >= 4 * window // PAGE - bound
        assert torch.isfinite(logits).all()
        with pytest.raises(ValueError, match="compacted"):
            cache.commit(sequence.handle, prompt[:24] + [0] * (4 * window))
        assert cache.tree.size_info().total == 0  # nothing of it ever entered the radix tree
        sequence.release()
        cache.check_integrity()


def test_a_window_larger_than_the_text_equals_plain_generation(model_and_prompt):
    model, prompt = model_and_prompt
    plain = generate(model, prompt, None, max_new_tokens=16)
    with new_cache(model) as cache:
        sequence, logits = PagedSequence.start(cache, model, prompt, policy=SinkWindow(4, 4096))
        assert decode(sequence, logits, 16) == plain.tokens
        assert not sequence.handle.compacted
        sequence.release()


def test_heavy_hitter_bounds_private_kv_with_real_attention_scores():
    model, tokenizer = smollm2.load_model()
    model.config._attn_implementation = "eager"  # attention weights feed the policy
    prompt = tokenizer("The keeper climbed the stairs of the lighthouse", return_tensors="pt").input_ids[0].tolist()
    with new_cache(model) as cache:
        sequence, logits = PagedSequence.start(cache, model, prompt, policy=HeavyHitter(budget=32))
        for _ in range(64):
            logits = sequence.forward([int(logits.argmax())])
            assert sequence.num_live <= 32
        assert sequence.scores.min() >= 0 and sequence.scores.max() > 0
        assert cache.stats().pool.used_pages <= 32 // PAGE + 2 + 2  # budget's pages + holes
        sequence.release()
        cache.check_integrity()
