"""GPU placement on the session's Ray cluster (a CPU head, two nodes advertising one GPU each): a
worker that asks for more GPUs than a node has is refused by a bounded start that names what is
missing and leaves nothing pending; one that holds a GPU its process cannot use (no CUDA) fails
to start instead of computing on the CPU. Workers holding one GPU each on distinct nodes, and
`cluster status` showing them, are in the CLI walk (tests/cli/test_cluster_cli.py)."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from tiered_cache.workers import cluster  # noqa: E402
from tiered_cache.workers.config import ClusterConfig, WorkerSettings  # noqa: E402

pytestmark = pytest.mark.slow
NAMESPACE = "gpu-placement"


@pytest.fixture
def connected(ray_cluster):
    ray.init(address=ray_cluster.address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    yield
    cluster.stop(NAMESPACE)
    ray.shutdown()


def test_a_worker_asking_for_more_gpus_than_any_node_has_is_refused_in_bounded_time(connected):
    seen = []
    config = ClusterConfig(namespace=NAMESPACE, shards=0, workers=1, start_timeout_s=3,
                           worker=WorkerSettings(num_gpus=2, device="cpu"))
    with pytest.raises(RuntimeError) as refused:
        cluster.start(config, progress=seen.append)
    message = str(refused.value)
    assert message.startswith("worker-0 not started within 3 s: each worker asks for 2 GPU(s)")
    assert "no node has 2 (the most on one node: 1)" in message and "worker.num_gpus: 0" in message
    assert any("2 GPU(s) each" in line for line in seen)
    deadline = time.monotonic() + 30  # not left pending in Ray's queue (the kill lands in the GCS soon after)
    while "worker-0" in ray.util.list_named_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "worker-0" not in ray.util.list_named_actors()


def test_a_worker_holding_a_gpu_without_cuda_fails_to_start_instead_of_computing_on_the_cpu(connected):
    config = ClusterConfig(namespace=NAMESPACE, shards=0, workers=1, start_timeout_s=120,
                           worker=WorkerSettings(num_gpus=1))  # device "auto": the GPU it holds
    with pytest.raises(RuntimeError, match=r"worker-0 failed to start: .*holds GPU 0 from Ray but CUDA is not "
                                           r"available .*worker.device: cpu"):
        cluster.start(config)
