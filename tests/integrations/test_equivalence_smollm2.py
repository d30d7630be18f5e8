"""On the real model (SmolLM2-135M-Instruct): greedy answers from a cache hit in host RAM, on disk
or in a remote store equal the answers without a cache, for fp32 and fp16 storage."""

import pytest
import torch
from equivalence_helpers import cache_with_prefix_in, push_down

from tiered_cache.bench.int8_quality import int8_quality
from tiered_cache.integrations.document import chat_prompt, document
from tiered_cache.integrations.smollm2 import load_model
from tiered_cache.integrations.transformers import generate, spec_for
from tiered_cache.server.process import StoreProcess

pytestmark = pytest.mark.slow
QUESTIONS = ["In what year was the lighthouse's lamp first lit?", "Who was the first keeper of the light?",
             "In what year was the light automated?"]
NEW_TOKENS = 8  # wrong KV shows in the first logits (checked to 1e-3) long before the 8th token


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_model()
    text = document()[:1500]  # about 350 tokens: the same code path as the demo, faster
    prompts = [chat_prompt(tokenizer, q, text) for q in QUESTIONS]
    prompts.append(chat_prompt(tokenizer, QUESTIONS[0], text[:1333]))  # a prefix ending mid-page
    reference = [generate(model, p, None, NEW_TOKENS, tokenizer.eos_token_id) for p in prompts]
    return model, tokenizer, prompts, reference


@pytest.fixture(scope="module")
def store():
    with StoreProcess(["--no-disk"]) as proc:
        yield proc


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_answers_from_a_cache_hit_equal_answers_without(smollm2, store, tmp_path, tier, dtype):
    model, tokenizer, prompts, reference = smollm2
    spec = spec_for(model, dtype, model_id=f"smollm2-{dtype}")
    writer = cache_with_prefix_in(tier, spec, tmp_path, store.address)
    reader = writer if tier != "remote" else cache_with_prefix_in(tier, spec, tmp_path, store.address)
    first = generate(model, prompts[0], writer, NEW_TOKENS, tokenizer.eos_token_id)
    assert first.tokens == reference[0].tokens
    for prompt, plain in zip(prompts[1:], reference[1:], strict=True):
        push_down(writer, tier)
        push_down(reader, tier)
        hit = generate(model, prompt, reader, NEW_TOKENS, tokenizer.eos_token_id)
        assert hit.reused_tokens >= 300 and tier in hit.sources, hit.sources
        assert hit.tokens == plain.tokens, (tokenizer.decode(hit.tokens), tokenizer.decode(plain.tokens))
        assert torch.allclose(hit.first_logits, plain.first_logits, atol=1e-3 if dtype == "fp32" else 5e-2)


def test_int8_storage_is_close_but_lossy(smollm2):
    model, tokenizer, prompts, _ = smollm2
    shared = prompts[0][:320]
    quality = int8_quality(model, prompts[:3], shared, NEW_TOKENS, tokenizer.eos_token_id)
    assert quality.prompts == 3
    assert 0 < quality.mean_kl < 0.05, quality  # lossy, but the next-token distribution barely moves
