"""Model identity in the page fingerprint (DESIGN.md §10): two models that differ in weights never
share a page; one checkpoint loaded twice, from any folder and process, shares all of them.
Small random-weight Llamas, no download."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.index.keys import PageKeyer
from tiered_cache.integrations.model_identity import derived_model_id, weights_identity
from tiered_cache.integrations.transformers import kv_of_cache, spec_for
from tiered_cache.model.hf_config import spec_from_hf_config

PAGE = 4
TOKENS = list(range(3, 3 + 8 * PAGE + 2))  # 8 full pages and a partial one

LOAD_AND_KEY = """
import json, sys, torch
from transformers import LlamaForCausalLM
from tiered_cache.index.keys import PageKeyer
from tiered_cache.integrations.transformers import spec_for
model = LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
spec = spec_for(model, "fp32", page_size=int(sys.argv[2]))
keys = PageKeyer(spec, "tenant").keys(json.loads(sys.argv[3]))
print(json.dumps({"model_id": spec.model_id, "fingerprint": spec.fingerprint, "keys": [k.hex() for k in keys]}))
"""


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def keys_of(model, namespace="tenant"):
    return PageKeyer(spec_for(model, "fp32", page_size=PAGE), namespace).keys(TOKENS)


def test_two_random_llamas_of_equal_geometry_share_no_page():
    a, b = tiny_llama(1), tiny_llama(2)
    spec_a, spec_b = spec_for(a, "fp32", page_size=PAGE), spec_for(b, "fp32", page_size=PAGE)
    assert spec_a.with_options(model_id="x") == spec_b.with_options(model_id="x")  # same geometry
    assert spec_a.fingerprint != spec_b.fingerprint
    assert spec_a.model_id.startswith("llama@weights:") and spec_a.model_id != spec_b.model_id
    keys_a, keys_b = keys_of(a), keys_of(b)
    assert len(keys_a) == 8 and not set(keys_a) & set(keys_b)
    assert keys_of(a) == keys_a  # deterministic for one model


def test_two_random_llamas_share_no_page_through_a_shared_disk_tier(tmp_path):
    a, b = tiny_llama(1), tiny_llama(2)
    config = CacheConfig(lower_tiers=["disk"], disk_path=str(tmp_path), write_policy="write_through",
                         pool_capacity="8MiB", host_capacity="8MiB")
    with torch.inference_mode():
        kv = kv_of_cache(a(torch.tensor([TOKENS]), use_cache=True).past_key_values)
    with TieredCache(spec_for(a, "fp32", page_size=PAGE), config) as writer:
        assert writer.put(TOKENS, kv) == 8 * PAGE
        if hasattr(writer, "flush"):  # write-through may be asynchronous
            writer.flush()
    with TieredCache(spec_for(b, "fp32", page_size=PAGE), config) as other_model:
        assert other_model.lookup(TOKENS) == 0
    with TieredCache(spec_for(a, "fp32", page_size=PAGE), config) as same_model:
        assert same_model.lookup(TOKENS) == 8 * PAGE


def test_one_checkpoint_in_two_folders_and_processes_shares_every_page(tmp_path):
    model = tiny_llama(3)
    folders = [tmp_path / "first", tmp_path / "elsewhere" / "copy"]
    for folder in folders:
        model.save_pretrained(folder)
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_AND_KEY, str(folder), str(PAGE), json.dumps(TOKENS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed + 1), "HF_HUB_OFFLINE": "1"})
             for seed, folder in enumerate(folders)]  # side by side: each spends its time importing
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr[-2000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert results[0] == results[1]
    assert len(results[0]["keys"]) == 8
    # ... and equal to the model that was saved: the identity is its weights, not where they lie.
    assert results[0]["model_id"] == spec_for(model, "fp32", page_size=PAGE).model_id
    assert results[0]["keys"] == [k.hex() for k in keys_of(model)]
    assert not set(results[0]["keys"]) & {k.hex() for k in keys_of(tiny_llama(4))}


def test_fine_tune_like_changes_change_the_identity():
    base = tiny_llama(5)
    identities = {weights_identity(base)}

    def changed(edit) -> str:
        model = copy.deepcopy(base)
        with torch.no_grad():
            edit(model)
        return weights_identity(model)

    layer = base.model.layers[0]
    edits = [
        lambda m: m.model.norm.weight[7].add_(1e-3),  # one element of a small tensor
        lambda m: m.model.layers[1].self_attn.q_proj.weight[13, 42].add_(1e-4),  # one element of a layer
        lambda m: m.model.embed_tokens.weight[501].add_(1e-3),  # one retrained token embedding row
        lambda m: m.model.layers[0].mlp.up_proj.weight.add_(  # a merged rank-1 LoRA, tiny but dense
            1e-6 * torch.randn(layer.mlp.up_proj.weight.shape[0], 1) @ torch.randn(1, 64)),
        lambda m: m.to(torch.bfloat16),  # same weights, another dtype: other KV bytes
    ]
    for edit in edits:
        identities.add(changed(edit))
    assert len(identities) == len(edits) + 1
    assert weights_identity(copy.deepcopy(base)) == weights_identity(base)


def test_config_fields_that_shape_the_kv_are_part_of_the_identity():
    base = tiny_llama(6)
    longer = copy.deepcopy(base)
    longer.config.rope_parameters = {**base.config.rope_parameters, "rope_theta": 500000.0}
    assert weights_identity(longer) != weights_identity(base)


def test_explicit_model_id_is_kept_and_unloaded_weights_raise():
    model = tiny_llama(7)
    assert spec_for(model, model_id="org/tiny@abc123").model_id == "org/tiny@abc123"
    with torch.device("meta"):
        unloaded = LlamaForCausalLM(model.config)
    with pytest.raises(ValueError, match=r"meta device.*model_id="):
        derived_model_id(unloaded)
    assert spec_for(unloaded, model_id="org/tiny@abc123").model_id == "org/tiny@abc123"


def test_spec_from_hf_config_needs_an_identity():
    config = tiny_llama(8).config.to_dict()
    assert config["_name_or_path"] == ""  # a model built in memory has none
    for cfg in (config, {k: v for k, v in config.items() if k != "_name_or_path"}):
        with pytest.raises(ValueError, match=r"no model identity.*model_id=.*spec_for\(model\).*hashes its weights"):
            spec_from_hf_config(cfg)
    spec = spec_from_hf_config(config, model_id="org/tiny@abc123", page_size=PAGE)
    assert (spec.model_id, spec.num_layers, spec.num_kv_heads, spec.head_dim) == ("org/tiny@abc123", 2, 2, 16)
    assert spec_from_hf_config({**config, "_name_or_path": "org/tiny"}).model_id == "org/tiny"
