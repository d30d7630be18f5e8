"""Where the cluster's actors run, decided without Ray (so the CPU suite tests every branch):
which device a worker computes on, how the shards spread over nodes, and what a start that
timed out was waiting for."""

from __future__ import annotations

from collections.abc import Sequence

from tiered_cache.workers.config import WorkerSettings


def compute_device(settings: WorkerSettings, gpu_ids: Sequence[str], cuda_available: bool) -> str:
    """"cuda" or "cpu" for a worker holding `gpu_ids` (what Ray gave it). Raises RuntimeError,
    naming what is missing, where the settings ask for a GPU the process cannot use: a worker
    never drops to a CPU by itself."""
    if settings.device == "cpu":
        return "cpu"
    if settings.device == "cuda" or gpu_ids:
        if cuda_available:
            return "cuda"
        held = f"holds GPU {', '.join(gpu_ids)} from Ray" if gpu_ids else "asks for CUDA (worker.device: cuda)"
        raise RuntimeError(f"this worker {held} but CUDA is not available in its process (a CPU-only torch, "
                           "or a node that only advertises GPUs): install a CUDA build of torch on the GPU "
                           "nodes, or set worker.device: cpu to compute on the CPU on purpose")
    return "cpu"


def shard_strategy(shards: int, alive_nodes: int) -> tuple[str, str]:
    """(placement group strategy, why): one shard per node where there are nodes enough, so a
    node lost takes one shard's pages with it, not several."""
    if alive_nodes >= shards:
        return "STRICT_SPREAD", f"one per node ({alive_nodes} node(s))"
    return "SPREAD", f"{shards} shards on {alive_nodes} node(s): some share a node"


def start_timeout_message(waiting: Sequence[str], timeout_s: float, gpus_each: float, workers_waiting: int,
                          node_gpus: Sequence[float], free_gpus: float) -> str:
    """What a `cluster start` that ran out of time says: which actors, and the likely reason.
    `node_gpus`: the GPUs of each alive node (a worker's GPUs must all be on one node)."""
    names = ", ".join(waiting)
    most = max(node_gpus, default=0.0)
    if workers_waiting and gpus_each > 0 and (most < gpus_each or free_gpus < gpus_each):
        where = (f"no node has {gpus_each:g} (the most on one node: {most:g})" if most < gpus_each
                 else f"{free_gpus:g} of the cluster's {sum(node_gpus):g} are free")
        return (f"{names} not started within {timeout_s:.0f} s: each worker asks for {gpus_each:g} GPU(s) and "
                f"{where}. Add GPU nodes (the autoscaler adds them for pending GPU actors, up to max_workers), "
                "or set worker.num_gpus: 0 to compute on CPUs")
    return (f"{names} not started within {timeout_s:.0f} s: still loading, or no node has the CPUs and "
            "resources they ask for (see `ray status`); raise start_timeout_s for a slow first start")
