import json
import math

import pytest
from conftest import run_cli_here as run_cli

from tiered_cache.model.presets import preset_spec
from tiered_cache.model.sizing import RequestMix, size_report
from tiered_cache.model.spec import KVSpec


def test_size_cli_reproduces_the_textbook_figure():
    out = run_cli("size", "--model", "llama-3-70b", "--context", "32768").stdout
    assert "327,680 B (320 KiB)" in out
    assert "10,737,418,240 B (10 GiB)" in out
    assert "use --gpus 2 or more" in out  # 70B bf16 weights do not fit in one 80 GiB GPU


def test_size_json_matches_the_library():
    data = json.loads(run_cli("size", "--model", "llama-3.1-8b", "--context", "8192",
                              "--gpu-memory", "24GiB", "--json").stdout)
    spec = preset_spec("llama-3.1-8b")
    assert data["bytes_per_token"] == spec.bytes_per_token == 131_072
    assert data["bytes_per_request"] == 8192 * 131_072
    assert data["fits"] is True
    usable = int(24 * 2**30 * 0.9)
    assert data["kv_budget"] == usable - data["weight_bytes"]
    assert data["tokens_fit"] == data["kv_budget"] // spec.bytes_per_token


def test_capacity_and_paging_against_brute_force():
    spec = KVSpec("toy", 2, 2, 8, page_size=16)  # 128 bytes per token
    mix = RequestMix.parse("10:50%,100:25%,1000:25%")
    report = size_report(spec, context=1000, weight_bytes=1_000_000, gpu_memory="10MiB",
                         memory_utilisation=0.5, mix=mix)
    budget = int(10 * 2**20 * 0.5) - 1_000_000
    assert report.kv_budget == budget
    assert report.pages_fit == budget // (128 * 16)
    assert report.requests_fit == report.pages_fit // math.ceil(1000 / 16)
    # Brute force over a population of 4 requests with the same shares.
    population = [10, 10, 100, 1000]
    paged = sum(math.ceil(n / 16) * 16 for n in population) / 4 * 128
    assert report.paged_bytes_per_request == pytest.approx(paged)
    assert report.paging_saving == pytest.approx(1 - paged / (1000 * 128))
    assert report.paged_waste_tokens_per_request == pytest.approx(
        sum(math.ceil(n / 16) * 16 - n for n in population) / 4)
    assert report.prealloc_concurrency == budget // (1000 * 128)
    assert report.paged_concurrency == int(budget // paged)


def test_request_mix_parsing_and_errors():
    assert RequestMix.parse("512,2048").shares == (0.5, 0.5)
    assert RequestMix.parse("1_000:3,10:1").lengths == (1000, 10)
    with pytest.raises(ValueError, match="LENGTH"):
        RequestMix.parse("abc:1")
    with pytest.raises(ValueError, match="longer than the context"):
        size_report(KVSpec("t", 1, 1, 1), context=100, weight_bytes=0, mix=RequestMix.parse("200"))


def test_size_cli_from_hf_config_and_errors(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "max_position_embeddings": 2048}))
    data = json.loads(run_cli("size", "--hf-config", str(cfg), "--json").stdout)
    assert data["context"] == 2048 and data["bytes_per_token"] == 2 * 4 * 2 * 64 * 2
    bad = run_cli("size", "--model", "nonexistent", check=False)
    assert bad.returncode == 2 and "unknown model 'nonexistent'" in bad.stderr
    bad = run_cli("size", "--gpu-memory", "lots", check=False)
    assert bad.returncode == 2 and "cannot read size 'lots'" in bad.stderr


def test_size_list_shows_every_preset():
    out = run_cli("size", "--list").stdout
    for name in ("llama-2-7b", "llama-3-70b", "mixtral-8x7b", "qwen2.5-7b", "smollm2-135m"):
        assert name in out


DEEPSEEK_V3 = {"_name_or_path": "deepseek-ai/DeepSeek-V3", "model_type": "deepseek_v3", "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "n_routed_experts": 256, "vocab_size": 129280,
               "max_position_embeddings": 163840, "torch_dtype": "bfloat16"}


def test_mla_is_sized_as_its_compressed_latent_not_as_heads(tmp_path):
    from tiered_cache.model.hf_config import read_hf_config, sizing_spec, spec_from_hf_config

    hf = read_hf_config(DEEPSEEK_V3)
    assert hf.mla_latent == 576 and not hf.weights_estimated
    assert sizing_spec(hf).bytes_per_token == (512 + 64) * 61 * 2 == 70_272  # not 128 heads × 2 × 192 ...
    with pytest.raises(ValueError, match="MLA"):
        spec_from_hf_config(DEEPSEEK_V3)  # the cache must not key pages of a geometry it cannot hold
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    out = run_cli("size", "--hf-config", str(path), "--context", "4096", "--json").stdout
    report = json.loads(out)
    assert report["bytes_per_token"] == 70_272
    assert any("MLA" in n for n in report["notes"]) and any("--weights" in n for n in report["notes"])


def test_architectures_it_cannot_size_are_refused_by_name():
    from tiered_cache.model.hf_config import read_hf_config

    with pytest.raises(ValueError, match="recurrent state"):
        read_hf_config({**DEEPSEEK_V3, "model_type": "jamba", "kv_lora_rank": None, "layers_block_type": ["mamba"]})


def test_size_flags_that_would_be_silently_wrong_are_refused(tmp_path):
    for args, message in ((["--context", "0"], "--context must be a positive number"),
                          (["--gpu-memory", "80"], "is 80 bytes: give a unit"),
                          (["--mix", "512:50%,2048:80%"], "add up to 130%, not 100%"),
                          (["--mix", "512:50%,2048:5"], "every share as a percentage, or none")):
        result = run_cli("size", *args, check=False)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    assert run_cli("size", "--mix", "512:5,2048:3", "--json").returncode == 0  # weights are normalised
    long = json.loads(run_cli("size", "--model", "llama-3.1-8b", "--context", "200000", "--json").stdout)
    assert any("max_position_embeddings" in n for n in long["notes"])
