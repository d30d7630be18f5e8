"""The vLLM connector on a real vLLM engine (CPU build, in `.venv-vllm`, which `make test`
builds), each instance its own process sharing a real store server: a second instance reuses
the first one's document prefix with the same greedy answer, only full blocks are stored, and a
dead store means recompute with the same answer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tiered_cache.service.client import StoreClient
from tiered_cache.service.process import StoreProcess

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
BLOCK = 128  # vLLM's block size on the CPU
Q1, Q2 = "In what year was the lighthouse's lamp first lit?", "In what year was the light automated?"
Q3 = "Who was the first keeper of the light?"


@pytest.fixture(scope="module")
def model_folder() -> str:
    if not VLLM_PYTHON.exists():
        pytest.fail("the vLLM venv is missing: run `make install-vllm` (make test builds it)")
    from tiered_cache.integrations.smollm2 import MODEL_DIR, cache_dir, load_model

    load_model()  # converts SmolLM2's GGUF to a safetensors folder once
    return str(cache_dir() / MODEL_DIR)


def run_instance(model: str, *args: str) -> dict:
    """One vLLM engine in its own process (eager mode: it starts in seconds): its answers
    (`rows`) and what its block stores did (`stores`)."""
    proc = subprocess.run([str(VLLM_PYTHON), "-m", "tiered_cache.integrations.vllm.instance", "--model", model,
                           "--eager", "--max-tokens", "12", *args], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"vLLM instance failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def instance(model: str, *args: str) -> list[dict]:
    return run_instance(model, *args)["rows"]


@pytest.fixture(scope="module")
def references(model_folder) -> list[dict]:
    """Q2, then Q3 (another slice of the document), answered by plain vLLM."""
    return instance(model_folder, "--no-connector", "--doc-per-question", "--doc-chars", "1500",
                    "-q", Q2, "-q", Q3)


@pytest.fixture(scope="module")
def reference(model_folder) -> dict:
    """Q2 answered by plain vLLM: no connector, empty prefix cache."""
    return instance(model_folder, "--no-connector", "-q", Q2)[0]


@pytest.mark.parametrize("groups", ["auto", "1"])
def test_a_second_instance_reuses_the_first_ones_prefix_through_the_store(model_folder, reference, groups):
    """Loaded layer group by layer group (auto: SmolLM2's 30 layers as 6 pages a block) or whole
    blocks before the forward (1): the same answer either way."""
    with StoreProcess(["--no-disk"]) as store:
        out = run_instance(model_folder, "--remote", store.address, "--layer-groups", groups, "-q", Q1)
        first, pages_per_block = out["rows"][0], out["stores"][0]["layer_groups"]
        assert first["num_cached_tokens"] == 0 and pages_per_block == (6 if groups == "auto" else 1)
        held = StoreClient(store.address).stats().tiers[0].pages
        assert held == first["prompt_tokens"] // BLOCK * pages_per_block  # full prompt blocks only
        second = instance(model_folder, "--remote", store.address, "--layer-groups", groups, "-q", Q2)[0]
        assert StoreClient(store.address).stats().tiers[0].pages == held  # B had nothing new to store
    shared = min(first["prompt_tokens"], second["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert second["num_cached_tokens"] == shared > 0  # the document's blocks came from the store
    assert second["tokens"] == reference["tokens"] and second["text"] == reference["text"]
    assert reference["num_cached_tokens"] == 0


def test_a_dead_store_means_recompute_and_the_same_answer(model_folder, reference):
    store = StoreProcess(["--no-disk"])
    store.start()
    address = store.address
    store.kill()
    answer = instance(model_folder, "--remote", address, "-q", Q2)[0]
    assert answer["num_cached_tokens"] == 0 and answer["tokens"] == reference["tokens"]


def test_the_store_killed_mid_run_means_recompute_and_the_same_answers(model_folder, references):
    """B's first answer reuses A's blocks; then the store is SIGKILLed; B's second answer (blocks
    A stored too) is computed instead, with the same tokens, and nothing hangs."""
    args = ["--doc-per-question", "--doc-chars", "1500", "-q", Q2, "-q", Q3]
    with StoreProcess(["--no-disk"]) as store:
        instance(model_folder, "--remote", store.address, *args)
        assert store.proc is not None
        first, second = instance(model_folder, "--remote", store.address, "--kill-after-first",
                                 str(store.proc.pid), *args)
        assert store.proc.wait(timeout=10) == -9
    assert first["num_cached_tokens"] > 0 and second["num_cached_tokens"] == 0
    assert [first["tokens"], second["tokens"]] == [r["tokens"] for r in references]


@pytest.fixture(scope="module")
def tuned_folder(model_folder, tmp_path_factory) -> str:
    """SmolLM2 "fine-tuned": every weight nudged, same geometry, tokenizer and config."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("smollm2-tuned")
    for path in Path(model_folder).iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    for path in Path(model_folder).glob("*.safetensors"):
        weights = load_file(path)
        save_file({k: v + 1e-3 * torch.randn_like(v) for k, v in weights.items()}, folder / path.name,
                  metadata={"format": "pt"})
    return str(folder)


def test_a_fine_tune_never_reads_its_base_models_blocks(model_folder, tuned_folder):
    with StoreProcess(["--no-disk"]) as store:
        out = run_instance(model_folder, "--remote", store.address, "-q", Q1)
        base = out["rows"][0]
        held = StoreClient(store.address).stats().tiers[0].pages
        assert held == base["prompt_tokens"] // BLOCK * out["stores"][0]["layer_groups"]
        tuned = instance(tuned_folder, "--remote", store.address, "-q", Q1)[0]
        assert tuned["num_cached_tokens"] == 0  # same prompt, same geometry, other weights: no block shared
        assert StoreClient(store.address).stats().tiers[0].pages == 2 * held  # its own blocks, beside the base's


def test_tiers_from_a_yaml_file_named_in_the_extra_config(model_folder, reference, tmp_path):
    config = tmp_path / "cache.yaml"
    config.write_text(f"lower_tiers: [disk]\ndisk_path: {tmp_path / 'blocks'}\nhost_capacity: 64MiB\n")
    first = instance(model_folder, "--config", str(config), "-q", Q1)[0]
    blocks = sorted((tmp_path / "blocks").rglob("*"))
    pages = [b for b in blocks if b.is_file() and b.name != ".lock"]
    assert len(pages) >= first["prompt_tokens"] // BLOCK  # written through to the disk tier the file names
    second = instance(model_folder, "--config", str(config), "-q", Q2)[0]
    assert second["num_cached_tokens"] > 0 and second["tokens"] == reference["tokens"]


def test_blocks_corrupted_on_disk_after_the_lookup_are_recomputed_with_the_same_answer(model_folder, reference,
                                                                                      tmp_path):
    """The disk tier's index says every block is there; half their pages have a flipped byte. The
    load finds the checksums wrong, reports those blocks, and vLLM recomputes them (the connector
    sets kv_load_failure_policy to recompute: vLLM's default would fail the request)."""
    disk = tmp_path / "blocks"
    instance(model_folder, "--disk", str(disk), "-q", Q1)
    pages = sorted(p for p in disk.rglob("*") if p.is_file() and p.name != ".lock")
    assert pages
    for page in pages[::2]:
        data = bytearray(page.read_bytes())
        data[len(data) // 2] ^= 0xFF
        page.write_bytes(bytes(data))
    out = run_instance(model_folder, "--disk", str(disk), "-q", Q2)
    assert out["stores"][0]["load_failures"] > 0
    assert out["rows"][0]["tokens"] == reference["tokens"] and out["rows"][0]["text"] == reference["text"]
