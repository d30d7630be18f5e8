"""A reused prefix reaches a transformers model with no copy beyond the pool read (`hf_context`),
and grouped-query attention runs over it without repeating its heads (`grouped_attention`):
answers and logits as with transformers' own `sdpa` and no cache. A random-weight model of the
tiny Llama shape (4 query heads per 2 KV heads), on the CPU."""

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from tiered_cache.bench.gpu_model import load_random_model
from tiered_cache.bench.gpu_sources import cache_config
from tiered_cache.cache import TieredCache
from tiered_cache.integrations.grouped_attention import NAME, use_grouped_attention
from tiered_cache.integrations.hf_context import context_from_pool
from tiered_cache.integrations.transformers import cache_keyword, generate, spec_for

PREFIX, SUFFIX = 256, 40


@pytest.fixture(scope="module")
def tiny():
    model = load_random_model("tiny", "cpu", torch.float32, 1024).model
    ids = torch.randint(0, model.config.vocab_size, (PREFIX + SUFFIX,), generator=torch.Generator().manual_seed(7))
    return model, ids.tolist()


def cached(model, ids, dtype="fp32"):
    spec = spec_for(model, dtype, page_size=16, model_id=f"tiny-{dtype}")
    cache = TieredCache(spec, cache_config("cpu", 2**24, 2**24))
    generate(model, ids[:PREFIX], cache, 1)
    return cache


def full_logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


def test_the_prefix_is_read_into_room_where_the_rest_and_the_answer_are_appended(tiny):
    model, ids = tiny
    with cached(model, ids) as cache:
        handle = cache.match(ids)
        try:
            pages = cache.load(handle)
            past = context_from_pool(model, cache.pool, pages, PREFIX, PREFIX + SUFFIX + 4)
            assert past is not None and past.get_seq_length() == PREFIX
            assert torch.equal(past.layers[1].keys[0].transpose(0, 1), cache.pool.read_tokens(pages, PREFIX)[1, 0])
            buffers = [layer.keys.data_ptr() for layer in past.layers]
            with torch.inference_mode():
                out = model(torch.tensor([ids[PREFIX:]]), **{cache_keyword(model): past}, use_cache=True)
                for token in range(3):  # decoding appends into the same room
                    out = model(torch.tensor([[token]]), **{cache_keyword(model): out.past_key_values}, use_cache=True)
        finally:
            cache.release(handle)
    layers = out.past_key_values.layers
    assert [layer.keys.data_ptr() for layer in layers] == buffers, "the model's appends copied the context"
    assert out.past_key_values.get_seq_length() == PREFIX + SUFFIX + 3


def test_a_past_out_of_room_grows_by_concatenation_and_stays_exact(tiny):
    model, ids = tiny
    with cached(model, ids) as cache:
        handle = cache.match(ids)
        try:
            past = context_from_pool(model, cache.pool, cache.load(handle), PREFIX, PREFIX)  # no room at all
            with torch.inference_mode():
                out = model(torch.tensor([ids[PREFIX:]]), **{cache_keyword(model): past}, use_cache=True)
        finally:
            cache.release(handle)
    assert out.past_key_values.get_seq_length() == PREFIX + SUFFIX
    assert torch.allclose(out.logits[0, -1], full_logits(model, ids), atol=1e-4)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_generate_from_the_pool_answers_as_without_a_cache(tiny, dtype):
    """fp16 pages under fp32 weights take the copying path (`context_from_pool` declines): both
    paths give the same answer as no cache."""
    model, ids = tiny
    plain = generate(model, ids, None, 6)
    with cached(model, ids, dtype) as cache:
        hit = generate(model, ids, cache, 6)
    assert hit.reused_tokens == PREFIX and hit.tokens == plain.tokens
    assert torch.allclose(hit.first_logits, plain.first_logits, atol=1e-4 if dtype == "fp32" else 5e-2)


def test_grouped_sdpa_equals_transformers_sdpa_without_repeating_kv_heads(tiny, monkeypatch):
    model, ids = tiny
    assert model.config._attn_implementation == NAME  # the bench's and load_causal_lm's models use it
    repeats = []
    real = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: repeats.append(n) or real(x, n))

    def reuse_forward():
        with cached(model, ids) as cache:
            handle = cache.match(ids)
            try:
                past = context_from_pool(model, cache.pool, cache.load(handle), PREFIX, PREFIX + SUFFIX + 1)
                with torch.inference_mode():
                    out = model(torch.tensor([ids[PREFIX:]]), **{cache_keyword(model): past}, use_cache=True)
                    step = model(torch.tensor([[5]]), **{cache_keyword(model): out.past_key_values}, use_cache=True)
                return out.logits[0], step.logits[0, -1]
            finally:
                cache.release(handle)

    grouped, grouped_step = reuse_forward()
    assert repeats == []  # the suffix (a 4D mask) and the decode step (one query, no mask) alike
    model.set_attn_implementation("sdpa")
    try:
        stock, stock_step = reuse_forward()
    finally:
        assert use_grouped_attention(model)
    assert repeats, "transformers' sdpa repeats KV heads under a mask: the check above could not fail"
    assert torch.allclose(grouped, stock, atol=1e-5) and torch.allclose(grouped_step, stock_step, atol=1e-5)


def test_a_model_on_another_attention_is_left_as_it_is():
    model = load_random_model("tiny", "cpu", torch.float32, 64).model
    model.set_attn_implementation("eager")
    assert use_grouped_attention(model) is False and model.config._attn_implementation == "eager"
