"""The vLLM connector on a real vLLM engine (CPU build, in `.venv-vllm`, which `make test`
builds; these tests run in `make test-vllm`, which CI runs after `make test`), each instance its
own process sharing a real store server: a second instance reuses
the first one's document prefix with the same greedy answer, only full blocks are stored, and a
dead store means recompute with the same answer.

Each instance is its own process, forked from one that imported vLLM once (forkserver.py: the
import is 6-10 s of a fresh process's 14 here). The instances that only store (A) and the
plain-vLLM references run once per module and the tests share them; every test still starts its
own reading instance (B), fresh, as a second serving instance would be."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiered_cache.client.store_client import StoreClient
from tiered_cache.integrations.vllm.forkserver import InstanceLauncher
from tiered_cache.server.process import StoreProcess

pytestmark = [pytest.mark.slow, pytest.mark.engine]
REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
BLOCK = 128  # vLLM's block size on the CPU
Q1, Q2 = "In what year was the lighthouse's lamp first lit?", "In what year was the light automated?"
Q3 = "Who was the first keeper of the light?"
# Question i asks about the i-th 2,000 characters of the document: the first question's prompt is
# then the one a plain `-q` asks (the first 2,000 characters), the second shares no block with it.
SLICES = ["--doc-per-question", "--doc-chars", "2000"]
GROUPED = ["--layer-groups", "6"]  # layer by layer (on the CPU "auto" loads whole blocks)


@pytest.fixture(scope="module")
def model_folder() -> str:
    if not VLLM_PYTHON.exists():
        pytest.fail("the vLLM venv is missing: run `make install-vllm` (make test builds it)")
    from tiered_cache.integrations.smollm2 import MODEL_DIR, cache_dir, load_model

    load_model()  # converts SmolLM2's GGUF to a safetensors folder once
    return str(cache_dir() / MODEL_DIR)


@pytest.fixture(scope="module")
def launcher(model_folder) -> Iterator[InstanceLauncher]:
    """Imports vLLM once (6-10 s here) and forks each instance, a process of its own, from it."""
    with InstanceLauncher(VLLM_PYTHON) as launcher:
        yield launcher


def run_instance(launcher: InstanceLauncher, model: str, *args: str) -> dict:
    """One vLLM engine in its own process (eager mode: it starts in seconds): its answers
    (`rows`) and what its block stores did (`stores`)."""
    return launcher.run_json(["--model", model, "--eager", "--max-tokens", "12", *args], timeout_s=600)


def instance(launcher: InstanceLauncher, model: str, *args: str) -> list[dict]:
    return run_instance(launcher, model, *args)["rows"]


def pages_held(store: StoreProcess) -> int:
    return StoreClient(store.address).stats().tiers[0].pages


def page_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != ".lock")


def test_the_launcher_reports_a_failed_instance_and_kills_one_past_its_time(launcher, model_folder):
    """Fork server faults, before the tests that rely on it: a failed child is an exit status and
    its stderr; a child past its time is killed, and the next one runs."""
    bad = launcher.run(["--model", model_folder, "--layer-groups"], timeout_s=60)
    assert bad.returncode == 2 and "--layer-groups: expected one argument" in bad.stderr
    with pytest.raises(TimeoutError, match="ran past 1 s and was killed"):
        launcher.run(["--model", model_folder, "--eager", "-q", Q1], timeout_s=1)
    again = launcher.run(["--model", model_folder, "--no-connector"], timeout_s=60)
    assert again.returncode == 2 and "required: -q/--question" in again.stderr


@pytest.fixture(scope="module")
def references(launcher, model_folder) -> list[dict]:
    """Q2 about the first slice (the prompt a plain `-q Q2` asks), Q3 about the second, answered
    by plain vLLM with its own prefix cache off: each a full prefill."""
    rows = instance(launcher, model_folder, "--no-connector", "--no-prefix-caching", *SLICES, "-q", Q2, "-q", Q3)
    assert [r["num_cached_tokens"] for r in rows] == [0, 0]
    return rows


@pytest.fixture(scope="module")
def reference(references) -> dict:
    """Q2 about the document's first 2,000 characters, without any cache."""
    return references[0]


@pytest.fixture(scope="module")
def store_after_a(launcher, model_folder):
    """A store server holding what instance A stored answering Q1 (6 layer groups: SmolLM2's 30
    layers as 6 pages a block, loaded layer by layer; "auto" on the CPU is whole blocks), and A's
    output and the pages the store held right after it."""
    with StoreProcess(["--no-disk"]) as store:
        out = run_instance(launcher, model_folder, "--remote", store.address, *GROUPED, "-q", Q1)
        yield store, out, pages_held(store)


def test_a_second_instance_reuses_the_first_ones_prefix_through_the_store(launcher, model_folder, reference,
                                                                          store_after_a):
    """Loaded layer group by layer group (whole blocks before the forward, the default on the CPU:
    the store-killed test)."""
    store, out, held_after_a = store_after_a
    first, pages_per_block = out["rows"][0], out["stores"][0]["layer_groups"]
    assert first["num_cached_tokens"] == 0 and pages_per_block == 6
    assert held_after_a == first["prompt_tokens"] // BLOCK * pages_per_block  # full prompt blocks only
    before = pages_held(store)
    out = run_instance(launcher, model_folder, "--remote", store.address, *GROUPED, "--metrics", "-q", Q2)
    second = out["rows"][0]
    assert pages_held(store) == before  # B had nothing new to store: its last, partial block is never saved
    shared = min(first["prompt_tokens"], second["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert second["num_cached_tokens"] == shared > 0  # the document's blocks came from the store
    assert second["tokens"] == reference["tokens"] and second["text"] == reference["text"]
    assert 0 < second["connector_s"] < second["latency_s"]  # time inside our hooks (bench vllm's column)
    # The worker side's figures reach vLLM's metrics beside the scheduler side's: the blocks it
    # loaded, and the time the forward waited for them layer by layer (what a router prices).
    blocks, waited = loaded(out["metrics"])
    assert blocks == shared // BLOCK and 0 < waited < second["latency_s"]


def loaded(metrics: dict[str, float]) -> tuple[int, float]:
    """(blocks loaded, seconds the forward waited for them) in an instance's `vllm:tiered_cache_*`
    counters."""
    def total(name: str) -> float:
        return sum(v for k, v in metrics.items() if k.startswith(f"vllm:tiered_cache_{name}_total{{"))

    return int(total("blocks_loaded")), total("load_seconds")


@pytest.fixture(scope="module")
def tuned_folder(model_folder, tmp_path_factory) -> str:
    """SmolLM2 "fine-tuned": every weight nudged, same geometry, tokenizer and config."""
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


def test_a_fine_tune_never_reads_its_base_models_blocks(launcher, tuned_folder, store_after_a):
    store, out, held_after_a = store_after_a
    before = pages_held(store)
    tuned = instance(launcher, tuned_folder, "--remote", store.address, *GROUPED, "-q", Q1)[0]
    assert tuned["prompt_tokens"] == out["rows"][0]["prompt_tokens"]  # the very prompt the base model stored
    assert tuned["num_cached_tokens"] == 0  # same prompt, same geometry, other weights: no block shared
    assert pages_held(store) == before + held_after_a  # its own blocks, beside the base's


def test_a_dead_store_means_recompute_and_the_same_answer(launcher, model_folder, reference):
    store = StoreProcess(["--no-disk"])
    store.start()
    address = store.address
    store.kill()
    answer = instance(launcher, model_folder, "--remote", address, "-q", Q2)[0]
    assert answer["num_cached_tokens"] == 0 and answer["tokens"] == reference["tokens"]


def test_the_store_killed_mid_run_means_recompute_and_the_same_answers(launcher, model_folder, references):
    """Whole blocks before the forward (layer groups "auto" on the CPU). B's first answer reuses
    A's blocks; then the store is SIGKILLed; B's second answer (blocks A stored too) is computed
    instead, with the same tokens, and nothing hangs."""
    args = [*SLICES, "-q", Q2, "-q", Q3]
    with StoreProcess(["--no-disk"]) as store:
        stored = run_instance(launcher, model_folder, "--remote", store.address, *args)
        assert stored["stores"][0]["layer_groups"] == 1
        assert store.proc is not None
        first, second = instance(launcher, model_folder, "--remote", store.address, "--kill-after-first",
                                 str(store.proc.pid), *args)
        assert store.proc.wait(timeout=10) == -9
    assert first["num_cached_tokens"] > 0 and second["num_cached_tokens"] == 0
    assert [first["tokens"], second["tokens"]] == [r["tokens"] for r in references]


@pytest.fixture(scope="module")
def disk_after_a(launcher, model_folder, tmp_path_factory):
    """A disk tier named in a tiered-cache YAML (kv_connector_extra_config.config), written
    through by instance A answering Q1: (the YAML, the folder, A's answer)."""
    where = tmp_path_factory.mktemp("vllm-disk")
    config = where / "cache.yaml"
    config.write_text(f"lower_tiers: [disk]\ndisk_path: {where / 'blocks'}\nhost_capacity: 64MiB\n")
    first = instance(launcher, model_folder, "--config", str(config), "-q", Q1)[0]
    return config, where / "blocks", first


def test_tiers_from_a_yaml_file_named_in_the_extra_config(launcher, model_folder, reference, disk_after_a):
    config, folder, first = disk_after_a
    assert len(page_files(folder)) >= first["prompt_tokens"] // BLOCK  # written through to the tier the file names
    out = run_instance(launcher, model_folder, "--config", str(config), "--metrics", "-q", Q2)
    second = out["rows"][0]
    assert second["num_cached_tokens"] > 0 and second["tokens"] == reference["tokens"]
    blocks, waited = loaded(out["metrics"])  # whole blocks, before the forward
    assert blocks == second["num_cached_tokens"] // BLOCK and 0 < waited < second["latency_s"]


def test_blocks_corrupted_on_disk_after_the_lookup_are_recomputed_with_the_same_answer(launcher, model_folder,
                                                                                      reference, disk_after_a,
                                                                                      tmp_path):
    """A copy of A's disk tier, where half the pages have a flipped byte: the tier's index says
    every block is there. The load finds the checksums wrong, reports those blocks, and vLLM
    recomputes them (the connector sets kv_load_failure_policy to recompute: vLLM's default
    would fail the request)."""
    disk = tmp_path / "blocks"
    shutil.copytree(disk_after_a[1], disk, ignore=shutil.ignore_patterns(".lock"))
    pages = page_files(disk)
    assert pages
    for page in pages[::2]:
        data = bytearray(page.read_bytes())
        data[len(data) // 2] ^= 0xFF
        page.write_bytes(bytes(data))
    out = run_instance(launcher, model_folder, "--disk", str(disk), "-q", Q2)
    assert out["stores"][0]["load_failures"] > 0
    assert out["rows"][0]["tokens"] == reference["tokens"] and out["rows"][0]["text"] == reference["text"]


VLLM_ASKS = """
import json
from vllm.plugins import load_general_plugins
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
load_general_plugins()  # as every vLLM process does: our entry point registers the connector by name
cls = KVConnectorFactory.get_connector_class_by_name("TieredCacheConnector")
print(json.dumps({"delivery": cls.requires_kv_delivery.fget(None),
                  "piecewise": {repr(g): cls.requires_piecewise_for_cudagraph({"layer_groups": g})
                                for g in ("auto", 1, "1", 6)},
                  "piecewise_default": cls.requires_piecewise_for_cudagraph({})}))
"""


def test_the_connector_says_what_vllm_asks_of_a_best_effort_per_layer_connector():
    """vLLM's scheduler makes a preempted request wait for (or recompute over) a hand-off when its
    connector requires delivery: a cache never does. CUDA graphs must run piecewise when loads wait
    per layer group, and need not when whole blocks load before the forward."""
    import json
    import subprocess

    run = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_ASKS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert said["delivery"] is False
    assert said["piecewise"] == {"'auto'": True, "1": False, "'1'": False, "6": True}
    assert said["piecewise_default"] is True


def test_vllm_s_own_kv_events_and_metrics_carry_our_blocks_and_figures(launcher, model_folder):
    """The connector hands its blocks to vLLM's publisher (`take_events`): a subscriber to vLLM's
    endpoint sees vLLM's GPU blocks and ours (medium CPU) under vLLM's own block hashes. Its
    figures (`get_kv_connector_stats` -> `build_prom_metrics`) are counters in the Prometheus
    registry vLLM's `/metrics` serves: the two requests' lookups, blocks asked, found and saved."""
    import threading

    import zmq

    from tiered_cache.bench.redis_process import free_port
    from tiered_cache.events.schema import decode_batch

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint)  # vLLM's publisher connects to a host:port endpoint (it binds only wildcards)
    payloads: list[bytes] = []
    done = threading.Event()

    def collect() -> None:
        while not done.is_set():
            if sub.poll(100):
                payloads.append(sub.recv_multipart()[-1])

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    try:
        out = run_instance(launcher, model_folder, "--kv-events", endpoint, "--metrics", "-q", Q1, "-q", Q3)
        deadline = time.monotonic() + 5
        while not payloads and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        done.set()
        reader.join(5)
        sub.close()
    rows, metrics = out["rows"], out["metrics"]
    events = [e for p in payloads for e in decode_batch(p)[1]]
    stored: dict[str, list] = {}
    for e in events:
        if e["type"] == "BlockStored":
            stored.setdefault(e["medium"], []).extend(e["block_hashes"])
    ours, gpu = stored.get("CPU", []), stored.get("GPU", [])
    assert gpu and len(set(ours)) >= rows[0]["prompt_tokens"] // BLOCK > 0
    assert set(ours) <= set(gpu)  # the same blocks under vLLM's own hashes
    told = next(e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU")
    assert told["block_size"] == BLOCK and len(told["token_ids"]) == BLOCK * len(told["block_hashes"])

    def total(name: str) -> float:
        return sum(v for k, v in metrics.items() if k.startswith(f"vllm:tiered_cache_{name}_total{{"))

    usable = [(r["prompt_tokens"] - 1) // BLOCK for r in rows]
    # vLLM's own prefix cache gave each request its leading blocks (the second, the document's):
    # only the blocks past them are asked of our tiers (new ones: none held), and no block is
    # saved, or told, twice.
    own = [r["num_cached_tokens"] // BLOCK for r in rows]
    asked = [max(0, u - o) for u, o in zip(usable, own, strict=True)]
    assert own[1] > 0 and total("lookups") == sum(a > 0 for a in asked) and total("blocks_asked") == sum(asked)
    assert total("blocks_hit") == 0 and len(ours) == len(set(ours)) == total("blocks_saved")
    assert total("saves_dropped") == 0 and total("load_failures") == 0
