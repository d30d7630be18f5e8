import json
import subprocess
import sys

import pytest

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.hf_config import read_hf_config, spec_from_hf_config
from tiered_cache.model.presets import get_preset, preset_names, preset_spec
from tiered_cache.model.spec import DType, KVSpec, Layout


def kv_bytes(layers, kv_heads, head_dim, itemsize):
    return 2 * layers * kv_heads * head_dim * itemsize


def test_llama_3_70b_textbook_figure():
    spec = preset_spec("llama-3-70b")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (80, 8, 128, DType.FP16)
    assert spec.bytes_per_token == 327_680 == 320 * 1024
    assert spec.bytes_for_tokens(32_768) == 10 * 2**30


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_sizes_follow_the_formula(name):
    spec = get_preset(name).spec
    assert spec.bytes_per_token == kv_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, 2)
    assert spec.bytes_per_page == spec.bytes_per_token * spec.page_size
    assert get_preset(name).num_params > 100_000_000


@pytest.mark.parametrize("name, params_billions", [
    ("llama-2-7b", 6.74), ("llama-2-70b", 68.98), ("llama-3.1-8b", 8.03), ("llama-3-70b", 70.55),
    ("mistral-7b", 7.24), ("mixtral-8x7b", 46.70), ("qwen2.5-7b", 7.62), ("smollm2-135m", 0.1345),
])
def test_parameter_counts_match_published_model_sizes(name, params_billions):
    assert get_preset(name).num_params / 1e9 == pytest.approx(params_billions, rel=0.005)


def test_smollm2_matches_the_measured_kv_size():
    # SmolLM2-135M: 30 layers x 2 (K, V) x 3 KV heads x 64 dims x 2 bytes = 23,040 bytes per token.
    assert preset_spec("smollm2-135m").bytes_per_token == 23_040


def test_preset_lookup_by_model_id_and_unknown_name():
    assert get_preset("Qwen/Qwen2.5-7B").name == "qwen2.5-7b"
    with pytest.raises(KeyError, match=r"unknown model 'gpt-17'.*llama-3-70b"):
        get_preset("gpt-17")


def test_from_hf_config_gqa_mqa_and_head_dim(tmp_path):
    base = {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8}
    mha = spec_from_hf_config(base, model_id="m")
    assert (mha.num_kv_heads, mha.head_dim) == (8, 64)
    mqa = spec_from_hf_config({**base, "num_key_value_heads": 1}, model_id="m")
    assert mqa.num_kv_heads == 1 and mqa.bytes_per_token == kv_bytes(4, 1, 64, 2)
    explicit = spec_from_hf_config({**base, "num_key_value_heads": 2, "head_dim": 256,
                                      "torch_dtype": "float32", "_name_or_path": "org/m"})
    assert (explicit.head_dim, explicit.dtype, explicit.model_id) == (256, DType.FP32, "org/m")
    # From a file and from a folder holding config.json, identical results.
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**base, "num_key_value_heads": 2}))
    assert spec_from_hf_config(folder, model_id="m") == spec_from_hf_config(folder / "config.json", model_id="m")
    assert spec_from_hf_config(folder, model_id="m").num_kv_heads == 2


def test_from_hf_config_reads_multimodal_text_config():
    cfg = {"_name_or_path": "vlm", "text_config": {"num_hidden_layers": 2, "hidden_size": 64,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2}}
    spec = spec_from_hf_config(cfg)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.model_id) == (2, 2, 16, "vlm")


@pytest.mark.parametrize("cfg, message", [
    ({"hidden_size": 64, "num_attention_heads": 4}, "missing required key 'num_hidden_layers'"),
    ({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3},
     "not a multiple"),
    ({"num_hidden_layers": 2, "hidden_size": 66, "num_attention_heads": 4}, "not divisible"),
    ({"num_hidden_layers": -1, "hidden_size": 64, "num_attention_heads": 4}, "positive integer"),
    ({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "torch_dtype": "int3"},
     "unknown KV dtype"),
])
def test_from_hf_config_errors_name_the_problem(cfg, message):
    with pytest.raises(ValueError, match=message):
        read_hf_config(cfg)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no Hugging Face config"):
        spec_from_hf_config(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        spec_from_hf_config(bad)


def test_spec_validation():
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        KVSpec("m", 0, 1, 1)
    with pytest.raises(ValueError, match="page_size"):
        KVSpec("m", 1, 1, 1, page_size=True)
    with pytest.raises(ValueError, match="layout"):
        KVSpec("m", 1, 1, 1, layout="xyz")
    assert KVSpec("m", 1, 1, 1, dtype="bf16", layout="hnd").layout is Layout.HND


def test_fingerprint_changes_with_every_byte_relevant_field():
    base = KVSpec("m", 2, 2, 64)
    variants = [base.with_options(model_id="n"), base.with_options(num_layers=3),
                base.with_options(num_kv_heads=1), base.with_options(head_dim=32),
                base.with_options(dtype=DType.BF16), base.with_options(page_size=32),
                base.with_options(layout=Layout.HND)]
    prints = {v.fingerprint for v in variants} | {base.fingerprint}
    assert len(prints) == len(variants) + 1
    assert KVSpec("m", 2, 2, 64).fingerprint == base.fingerprint
    assert len(bytes.fromhex(base.fingerprint)) == 32


def test_kv_dtype_and_layout_change_every_page_key():
    # Same model and tokens, but the page bytes differ: no page may be shared.
    tokens = list(range(64))
    base = KVSpec("org/m@rev", 2, 2, 64)
    keys = PageKeyer(base, "t").keys(tokens)
    assert len(keys) == 4 and keys == PageKeyer(KVSpec("org/m@rev", 2, 2, 64), "t").keys(tokens)
    for other in (base.with_options(dtype=DType.BF16), base.with_options(dtype=DType.FP32),
                  base.with_options(layout=Layout.HND)):
        assert not set(PageKeyer(other, "t").keys(tokens)) & set(keys), other


def test_fingerprint_is_equal_in_another_process():
    code = ("from tiered_cache.model.presets import preset_spec;"
            "print(preset_spec('mixtral-8x7b', page_size=64).fingerprint)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123"})
    assert other.stdout.strip() == preset_spec("mixtral-8x7b", page_size=64).fingerprint


def test_dict_round_trip_and_unknown_field():
    spec = preset_spec("qwen2.5-7b", dtype="bf16")
    assert KVSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown KVSpec field"):
        KVSpec.from_dict({**spec.to_dict(), "colour": "red"})


def test_shapes_follow_the_layout_contract():
    nhd = KVSpec("m", 3, 2, 8, page_size=4)
    hnd = nhd.with_options(layout=Layout.HND)
    assert nhd.kv_shape(5) == (3, 2, 5, 2, 8)
    assert nhd.pool_shape(10) == (2, 3, 10, 4, 2, 8)
    assert hnd.pool_shape(10) == (2, 3, 10, 2, 4, 8)
    assert nhd.staging_shape(7) == (7, 3, 2, 4, 2, 8)
    assert (nhd.pages_for_tokens(9), nhd.full_pages(9)) == (3, 2)
