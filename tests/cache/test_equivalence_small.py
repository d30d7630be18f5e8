"""Greedy decoding with a cache hit equals decoding without a cache: a small random-weight Llama
(no download), every tier, fp32 and fp16 storage, prefixes on and off page boundaries."""

import pytest
import torch
from equivalence_helpers import cache_with_prefix_in, push_down
from transformers import LlamaConfig, LlamaForCausalLM

from tiered_cache.integrations.transformers import generate, spec_for
from tiered_cache.server.process import StoreProcess

PAGE = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2)  # sharper than the default, so wrong KV shows
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def store():
    with StoreProcess(["--no-disk"]) as proc:
        yield proc


def prompts():
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 512, (37,), generator=gen).tolist()
    return [shared + torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 11, 0)] + [shared[:24]]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("tier", ["device", "host", "disk", "remote"])
def test_cache_hits_decode_exactly_like_no_cache(model, store, tmp_path, tier, dtype):
    spec = spec_for(model, dtype, page_size=PAGE, model_id=f"tiny-llama-{dtype}")
    writer = cache_with_prefix_in(tier, spec, tmp_path, store.address)
    reader = writer if tier != "remote" else cache_with_prefix_in(tier, spec, tmp_path, store.address)
    ps = prompts()
    no_cache = [generate(model, p, None, max_new_tokens=12) for p in ps]
    reference = [r.tokens for r in no_cache]
    writer_result = generate(model, ps[0], writer, max_new_tokens=12)  # caches the shared prefix
    assert writer_result.tokens == reference[0] and writer_result.stored_tokens == 40
    push_down(writer, tier)
    tolerance = 1e-4 if dtype == "fp32" else 3e-2  # fp16 storage rounds K and V to 11 bits
    for prompt, expected, plain in zip(ps[1:], reference[1:], no_cache[1:], strict=True):
        push_down(reader, tier)  # each prompt finds the prefix in the tier under test
        result = generate(model, prompt, reader, max_new_tokens=12)
        assert (result.first_logits - plain.first_logits).abs().max() < tolerance
        assert result.reused_tokens > 0, "the shared prefix should have come from the cache"
        expected_tier = {"remote": "remote", "disk": "disk", "host": "host"}.get(tier, "device")
        assert expected_tier in result.sources, result.sources
        assert result.tokens == expected, f"{tier}/{dtype}: cached KV changed the greedy output"


def test_prefix_off_a_page_boundary_reuses_whole_pages_only(model, tmp_path):
    spec = spec_for(model, "fp32", page_size=PAGE, model_id="tiny")
    cache = cache_with_prefix_in("host", spec, tmp_path)
    prompt = prompts()[0]  # 40 tokens: exactly 10 pages
    generate(model, prompt[:38], cache)  # 38 tokens: 9 full pages cached, 2 tokens not
    result = generate(model, prompt, cache)
    assert result.reused_tokens == 36 and result.tokens == generate(model, prompt, None).tokens
    whole = generate(model, prompt, cache)  # now all 40 are cached: the last token is recomputed
    assert whole.reused_tokens == 39 and whole.tokens == result.tokens


def test_a_model_that_fails_mid_request_leaves_no_lock_behind(model, tmp_path):
    spec = spec_for(model, "fp32", page_size=PAGE, model_id="tiny")
    cache = cache_with_prefix_in("host", spec, tmp_path)
    prompt = prompts()[0]
    generate(model, prompt, cache)
    bad = prompt[:36] + [10_000] * 6  # a token id past the vocabulary: the embedding raises
    with pytest.raises(IndexError):
        generate(model, bad, cache)
    assert cache.tree.size_info().protected == 0  # the matched prefix was unlocked again
    cache.check_integrity()
