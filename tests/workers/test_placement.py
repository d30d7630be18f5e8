"""Where workers compute and how shards spread, decided without Ray (workers/placement.py), and
the weights' and KV's dtype a worker picks (integrations/hf_models.py)."""

from __future__ import annotations

import pytest
import torch

from tiered_cache.integrations.hf_models import kv_dtype_for, weights_dtype
from tiered_cache.workers.config import ClusterConfig, WorkerSettings
from tiered_cache.workers.placement import compute_device, shard_strategy, start_timeout_message


def test_a_worker_holding_a_gpu_computes_on_it_and_never_drops_to_the_cpu_by_itself():
    auto = WorkerSettings(num_gpus=1)
    assert compute_device(auto, ["0"], cuda_available=True) == "cuda"
    with pytest.raises(RuntimeError, match=r"holds GPU 3 from Ray but CUDA is not available.*worker.device: cpu"):
        compute_device(auto, ["3"], cuda_available=False)
    assert compute_device(WorkerSettings(num_gpus=1, device="cpu"), ["0"], cuda_available=False) == "cpu"
    assert compute_device(WorkerSettings(), [], cuda_available=True) == "cpu"  # asked for none: none used
    with pytest.raises(RuntimeError, match="asks for CUDA"):
        compute_device(WorkerSettings(num_gpus=1, device="cuda"), [], cuda_available=False)


@pytest.mark.parametrize(("change", "message"), [
    ({"device": "gpu"}, "worker.device must be one of auto, cuda, cpu"),
    ({"device": "cuda"}, "worker.device: cuda needs worker.num_gpus > 0"),
    ({"num_gpus": -1}, "worker.num_gpus and worker.num_cpus must be >= 0"),
    ({"weights_dtype": "fp8"}, "worker.weights_dtype must be one of auto, fp32, fp16, bf16"),
])
def test_worker_settings_refuse_what_would_run_elsewhere_than_asked(change, message):
    with pytest.raises(ValueError, match=message):
        WorkerSettings(**change)


def test_cluster_config_reads_gpu_placement_and_refuses_a_null_gpu_count():
    config = ClusterConfig.from_dict({"start_timeout_s": 30, "worker": {"num_gpus": 1, "device": "cpu"}})
    assert (config.worker.num_gpus, config.worker.device, config.start_timeout_s) == (1, "cpu", 30)
    assert ClusterConfig.from_dict({"worker": {"num_gpus": None}}).worker.num_gpus == 0  # null: the default
    with pytest.raises(ValueError, match="start_timeout_s must be positive"):
        ClusterConfig(start_timeout_s=0)


def test_shards_go_one_per_node_where_there_are_nodes_enough():
    assert shard_strategy(2, 3)[0] == "STRICT_SPREAD"
    assert shard_strategy(3, 3)[0] == "STRICT_SPREAD"
    strategy, why = shard_strategy(3, 2)
    assert strategy == "SPREAD" and "3 shards on 2 node(s)" in why


def test_a_start_that_timed_out_names_the_missing_gpus_or_says_what_else_it_waited_for():
    none = start_timeout_message(["worker-0", "worker-1"], 600, 1, 2, [0.0, 0.0], 0.0)
    assert none.startswith("worker-0, worker-1 not started within 600 s") and "no node has 1" in none
    assert "worker.num_gpus: 0" in none
    too_many = start_timeout_message(["worker-0"], 5, 2, 1, [1.0, 1.0], 2.0)
    assert "no node has 2 (the most on one node: 1)" in too_many
    taken = start_timeout_message(["worker-2"], 5, 1, 1, [1.0, 1.0], 0.0)
    assert "0 of the cluster's 2 are free" in taken
    loading = start_timeout_message(["shard-0"], 5, 1, 0, [1.0], 1.0)
    assert "GPU" not in loading and "start_timeout_s" in loading


def test_weights_are_bf16_on_a_gpu_and_fp32_on_a_cpu_unless_asked_and_the_kv_follows():
    assert weights_dtype("auto", "cuda") is torch.bfloat16 and weights_dtype("auto", "cuda:1") is torch.bfloat16
    assert weights_dtype("auto", "cpu") is torch.float32 and weights_dtype("fp16", "cpu") is torch.float16
    with pytest.raises(ValueError, match="unknown weights dtype 'int4'"):
        weights_dtype("int4", "cpu")
    model = torch.nn.Linear(2, 2)
    assert kv_dtype_for("auto", model) == "fp16"  # fp32 weights: fp16 pages (half the bytes)
    assert kv_dtype_for("auto", model.to(torch.bfloat16)) == "bfloat16"  # never squeezed into fp16's range
    assert kv_dtype_for("fp32", model) == "fp32"
