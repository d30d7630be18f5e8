"""The vLLM connector's block tiers and layer-by-layer loads, without vLLM: layer groups, pages
through a real store server, and a load job that never copies KV in after it gave up."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from tiered_cache.client.store_client import StoreClient
from tiered_cache.config import CacheConfig
from tiered_cache.integrations.vllm.block_copy import HostBlocks
from tiered_cache.integrations.vllm.block_tiers import BlockTiers
from tiered_cache.integrations.vllm.identity import vllm_spec
from tiered_cache.integrations.vllm.layer_groups import TARGET_PAGE_BYTES, group_keys, group_size
from tiered_cache.integrations.vllm.layout import gather_blocks
from tiered_cache.integrations.vllm.load_job import LoadJob
from tiered_cache.server.process import StoreProcess

LAYERS, HEADS, DIM, BS = 6, 2, 8, 4
SPEC = vllm_spec("test-model@weights:abc", LAYERS, HEADS, DIM, "float32", BS)


def remote_config(address: str, **more) -> CacheConfig:
    return CacheConfig.from_dict({"lower_tiers": ["remote"], "remote_addresses": [address], **more})


def vllm_layers(num_blocks: int = 8, fill: float | None = None) -> list[torch.Tensor]:
    """vLLM's CPU KV: per layer (blocks, heads, block_size, 2 * dim)."""
    shape = (num_blocks, HEADS, BS, 2 * DIM)
    return [torch.full(shape, fill) if fill is not None else torch.randn(shape) for _ in range(LAYERS)]


@pytest.mark.parametrize(("layers", "per_layer", "expected"), [
    (30, 196_608, 5),  # SmolLM2 in float32, 128-token blocks: 5 layers ~ 0.94 MiB
    (32, 4 << 20, 1),  # a layer alone is past 1 MiB: one layer a page
    (7, 1024, 7),  # small pages: the whole block is one page
    (30, 300_000, 3),  # the most layers within 1 MiB that divide 30 (4 would not)
])
def test_auto_groups_are_the_most_layers_within_a_mebibyte_that_divide_the_model(layers, per_layer, expected):
    size = group_size(layers, per_layer, "auto")
    assert size == expected and layers % size == 0
    assert size == 1 or size * per_layer <= TARGET_PAGE_BYTES


def test_auto_loads_whole_blocks_when_the_kv_lives_in_cpu_memory():
    assert group_size(30, 196_608, "auto", kv_on_cpu=True) == 30
    assert group_size(30, 196_608, None, kv_on_cpu=True) == 30
    assert group_size(30, 196_608, 6, kv_on_cpu=True) == 5  # an explicit count still wins


def test_an_explicit_group_count_must_divide_the_layers():
    assert group_size(30, 1000, 6) == 5 and group_size(30, 1000, 1) == 30
    for bad in (7, 0, -1, "three", True):
        with pytest.raises(ValueError, match=r"divides the model's 30 layers \(1, 2, 3, 5, 6, 10, 15, 30\)"):
            group_size(30, 1000, bad)


def test_group_keys_differ_by_group_and_one_group_is_the_block_key():
    blocks = [bytes([i]) * 32 for i in range(3)]
    assert group_keys(blocks, 1, 0) == blocks
    per_group = [group_keys(blocks, 4, g) for g in range(4)]
    assert len({k for keys in per_group for k in keys}) == 12 and not set(blocks) & set(per_group[0])
    assert group_keys(blocks, 4, 2) == per_group[2]  # deterministic
    with pytest.raises(ValueError, match="out of range"):
        group_keys(blocks, 4, 4)


def test_blocks_go_through_a_store_server_as_layer_group_pages():
    with StoreProcess(["--no-disk"]) as server:
        writer = BlockTiers(SPEC, remote_config(server.address), layers_per_page=2)
        assert (writer.num_groups, writer.spec.num_layers) == (3, 2) and writer.spec.fingerprint != SPEC.fingerprint
        keys = writer.keys(list(range(3 * BS + 1)), "tenant")  # 3 full blocks, a partial one
        assert len(keys) == 3
        layers = vllm_layers()
        blocks = gather_blocks(layers, [5, 1, 6], "cpu", DIM)
        assert writer.save(keys, blocks) and writer.flush(10)
        assert writer.chain.tiers[1].stats().errors == 0
        assert StoreClient(server.address).stats().tiers[0].pages == 9  # 3 blocks x 3 groups
        assert all(writer.stored_below(k) for k in keys)

        reader = BlockTiers(SPEC, remote_config(server.address), layers_per_page=2)  # another process's
        assert reader.leading(keys) == 3
        for group in range(3):
            pages = reader.load(keys, group)
            assert [p.shape for p in pages] == [(2, 2, HEADS, BS, DIM)] * 3
            for page, block in zip(pages, blocks, strict=True):
                assert torch.equal(page, block[2 * group:2 * group + 2])
        # Another grouping of the same model shares no page: its keys and fingerprint differ.
        whole = BlockTiers(SPEC, remote_config(server.address))
        assert whole.num_groups == 1 and whole.leading(whole.keys(list(range(3 * BS + 1)), "tenant")) == 0
        assert reader.leading(reader.keys(list(range(3 * BS + 1)), "other tenant")) == 0


def test_the_connector_s_tiers_follow_a_store_server_to_its_new_address(tmp_path):
    """A shard back on another port (its address file rewritten, as each Serve replica keeps it):
    the engine's saves go there and its lookups ask there, without a restart."""
    from tiered_cache.cache.address_file import write_addresses

    listed = tmp_path / "shards"
    with StoreProcess(["--no-disk"]) as old, StoreProcess(["--no-disk"]) as new:
        write_addresses(listed, [old.address])
        tiers = BlockTiers(SPEC, remote_config(old.address, remote_addresses_file=str(listed)))
        first, second = tiers.keys(list(range(2 * BS)), ""), tiers.keys(list(range(100, 100 + 2 * BS)), "")
        assert tiers.save(first, gather_blocks(vllm_layers(), [0, 1], "cpu", DIM)) and tiers.flush(10)
        assert StoreClient(old.address).stats().tiers[0].pages == 2
        write_addresses(listed, [new.address])
        assert tiers.address_file is not None and tiers.address_file.check()
        assert tiers.save(second, gather_blocks(vllm_layers(), [2, 3], "cpu", DIM)) and tiers.flush(10)
        assert StoreClient(new.address).stats().tiers[0].pages == 2  # saved at the new address
        assert StoreClient(old.address).stats().tiers[0].pages == 2
        reader = BlockTiers(SPEC, remote_config(old.address, remote_addresses_file=str(listed)))
        assert reader.leading(second) == 2  # a new engine reads the file at start


def test_a_block_missing_one_layer_group_is_not_held():
    tiers = BlockTiers(SPEC, CacheConfig(), layers_per_page=3)
    keys = tiers.keys(list(range(3 * BS)), "")
    tiers.save(keys, gather_blocks(vllm_layers(), [0, 1, 2], "cpu", DIM))
    assert tiers.flush(10) and tiers.leading(keys) == 3
    tiers.chain.delete([tiers.page_keys(keys, 1)[1]], 0)  # block 1 lost its second group
    assert tiers.leading(keys) == 1


def _job(tiers: BlockTiers, dst: list[torch.Tensor], keys: list[bytes], ids: list[int], **kw) -> LoadJob:
    return LoadJob(tiers, HostBlocks(dst, "cpu", DIM), [(keys, ids)], **kw)


def test_a_load_job_copies_in_group_by_group_and_reports_missing_blocks():
    tiers = BlockTiers(SPEC, CacheConfig(), layers_per_page=2)
    src = vllm_layers()
    keys = tiers.keys(list(range(4 * BS)), "")
    tiers.save(keys[:3], gather_blocks(src, [0, 1, 2], "cpu", DIM))  # the 4th block never saved
    assert tiers.flush(10)
    dst = vllm_layers(fill=0.0)
    job = _job(tiers, dst, keys, [4, 5, 6, 7])
    threading.Thread(target=job.run).start()
    for group in range(3):
        for layer in tiers.layers_of(group):
            job.wait_for(group, f"layer.{layer}")
            assert job.ready[group].is_set()
            for src_id, dst_id in ((0, 4), (1, 5), (2, 6)):
                assert torch.equal(dst[layer][dst_id], src[layer][src_id])
    assert job.finish({f"layer.{i}" for i in range(LAYERS)}) == 0
    assert job.failed == {7} and not dst[0][7].any()


def test_layers_that_attended_without_waiting_fail_every_block_of_the_job():
    tiers = BlockTiers(SPEC, CacheConfig(), layers_per_page=2)
    keys = tiers.keys(list(range(2 * BS)), "")
    tiers.save(keys, gather_blocks(vllm_layers(), [0, 1], "cpu", DIM))
    assert tiers.flush(10)
    job = _job(tiers, vllm_layers(fill=0.0), keys, [3, 4])
    job.run()
    job.wait_for(0, "layer.0")  # the other layers never waited
    assert job.finish({f"layer.{i}" for i in range(LAYERS)}) == LAYERS - 1
    assert job.failed == {3, 4}


def test_a_load_that_outlives_its_wait_is_failed_and_never_copied_in():
    """The forward's wait gives up while the load is still out: every block of the job is failed,
    and the pages that arrive afterwards (real pages from a real store server, held back until
    the wait has given up) are not copied in: vLLM may already have given those blocks to another
    request."""
    with StoreProcess(["--no-disk"]) as server:
        writer = BlockTiers(SPEC, remote_config(server.address), layers_per_page=2)
        keys = writer.keys(list(range(2 * BS)), "")
        writer.save(keys, gather_blocks(vllm_layers(), [0, 1], "cpu", DIM))
        assert writer.flush(10)
        reader = BlockTiers(SPEC, remote_config(server.address), layers_per_page=2)
        assert reader.leading(keys) == 2
        gave_up, loaded = threading.Event(), []
        load = reader.load

        def load_after_the_wait(block_keys, group=0, lease=None):
            gave_up.wait(30)
            pages = load(block_keys, group, lease)
            loaded.append(sum(p is not None for p in pages))
            return pages

        reader.load = load_after_the_wait
        dst = vllm_layers(fill=0.0)
        job = _job(reader, dst, keys, [2, 3], wait_s=0.2)
        threading.Thread(target=job.run).start()
        job.wait_for(0, "layer.0")
        gave_up.set()
        assert job.done.wait(30)
        assert loaded and loaded[0] == 2  # the pages did arrive, after the wait
        assert job.failed == {2, 3}
        assert not any(layer.any() for layer in dst)  # and none was copied in


def test_a_stopped_store_server_never_hangs_the_forward_nor_gives_wrong_kv():
    """A store server that stops answering (SIGSTOP) as the load starts: the forward's wait ends,
    and the job ends either with every block failed and nothing copied in, even once the server
    answers again (SIGCONT), or, where the pages were read before the stop took hold, with
    exactly the saved blocks. Which one depends on the machine's timing; wrong KV never."""
    with StoreProcess(["--no-disk"]) as server:
        writer = BlockTiers(SPEC, remote_config(server.address), layers_per_page=2)
        keys = writer.keys(list(range(2 * BS)), "")
        src = vllm_layers()
        writer.save(keys, gather_blocks(src, [0, 1], "cpu", DIM))
        assert writer.flush(10)
        reader = BlockTiers(SPEC, remote_config(server.address, remote_timeout_s=30.0), layers_per_page=2)
        assert reader.leading(keys) == 2
        dst = vllm_layers(fill=0.0)
        job = _job(reader, dst, keys, [2, 3], wait_s=0.5)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            threading.Thread(target=job.run).start()
            job.wait_for(0, "layer.0")
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert job.done.wait(30)
        if job.failed:
            assert job.failed == {2, 3}
            assert not any(layer.any() for layer in dst)
        else:
            assert all(torch.equal(d[[2, 3]], s[[0, 1]]) for d, s in zip(dst, src, strict=True))


def test_pages_lent_from_the_arena_and_written_over_before_the_check_are_read_again(tmp_path):
    """A same-host store server with a 2 MiB arena (no lease) lends the pages as views into it.
    Between the get and the check, another client's Put comes round the arena over them (for
    real; they go to the disk tier): the job sees it, reads those pages again as copies, and
    vLLM's KV ends with exactly the saved blocks, none failed."""
    from tiered_cache.index.keys import PageKeyer
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.wire.codec import encode_page

    big = KVSpec("ring-filler", 4, 2, 64, page_size=64, dtype="fp32")  # 256 KiB pages
    fillers = [[(k, encode_page(torch.randn(big.staging_shape(1)[1:]), big, k, "raw"))
                for k in PageKeyer(big, f"filler-{i}").keys(list(range(big.page_size * 10)))] for i in range(3)]
    with StoreProcess(["--disk", str(tmp_path), "--ram", "2MiB", "--arena-lease", "0"]) as server:
        writer = BlockTiers(SPEC, remote_config(server.address), layers_per_page=2)
        src = vllm_layers()
        keys = writer.keys(list(range(3 * BS)), "")
        writer.save(keys, gather_blocks(src, [0, 1, 2], "cpu", DIM))
        assert writer.flush(10)
        reader = BlockTiers(SPEC, remote_config(server.address), layers_per_page=2)
        assert reader.leading(keys) == 3
        other = StoreClient(server.address)
        load = reader.load

        def load_then_fill(block_keys, group=0, lease=None):
            pages = load(block_keys, group, lease)
            if lease is not None and len(lease):
                other.put(fillers.pop())  # new pages (a page held already is not placed again): over the lent ones
            return pages

        reader.load = load_then_fill
        dst = vllm_layers(fill=0.0)
        job = _job(reader, dst, keys, [5, 6, 7])
        job.run()
        assert job.finish(set()) == 0 and job.failed == set()
        assert reader.lent_lost == 3 * 3  # every page of every group was lent, then written over
        for layer in range(LAYERS):
            for src_id, dst_id in ((0, 5), (1, 6), (2, 7)):
                assert torch.equal(dst[layer][dst_id], src[layer][src_id])
        other.close()


def test_a_load_started_by_the_scheduler_is_taken_by_the_job_that_follows():
    """Whole blocks from a same-host store server: `prefetch` (the scheduler found them) starts the
    load; the load job for exactly those blocks copies what it loaded, and the KV is exact. It
    starts only where a worker loads in this process, and only for whole blocks."""
    with StoreProcess(["--no-disk"]) as server:
        writer = BlockTiers(SPEC, remote_config(server.address))
        src = vllm_layers()
        keys = writer.keys(list(range(3 * BS)), "")
        writer.save(keys, gather_blocks(src, [0, 1, 2], "cpu", DIM))
        assert writer.flush(10)
        reader = BlockTiers(SPEC, remote_config(server.address))
        assert not reader.prefetch(keys)  # no worker registered here: nothing would take it
        reader.loads_here = True
        assert reader.prefetch(keys) and reader.prefetch(keys)  # once per set of blocks
        dst = vllm_layers(fill=0.0)
        job = _job(reader, dst, keys, [5, 6, 7])
        job.run()
        assert job.finish(set()) == 0 and job.failed == set() and reader.prefetches_taken == 1
        for layer in range(LAYERS):
            for src_id, dst_id in ((0, 5), (1, 6), (2, 7)):
                assert torch.equal(dst[layer][dst_id], src[layer][src_id])
        assert reader.take_prefetch(keys) is None  # taken once
        grouped = BlockTiers(SPEC, remote_config(server.address), layers_per_page=2)
        grouped.loads_here = True
        assert not grouped.prefetch(grouped.keys(list(range(3 * BS)), ""))  # group 0 must not wait for the last


def test_a_hint_starts_the_held_blocks_toward_this_process_before_the_load():
    """`promote`: of a prompt's blocks, the leading ones the store holds start toward the reader
    (its load job's prefetch where one can be taken, else its RAM tier); the load then finds them
    there with the bytes saved. Blocks no tier holds start nothing."""
    with StoreProcess(["--no-disk"]) as server:
        src = vllm_layers()
        for per_page in (2, None):  # the two pages of a block the readers below ask for
            writer = BlockTiers(SPEC, remote_config(server.address), layers_per_page=per_page)
            keys = writer.keys(list(range(4 * BS)), "")  # a grouping's keys of its own
            writer.save(keys[:3], gather_blocks(src, [0, 1, 2], "cpu", DIM))  # the 4th never saved
            assert writer.flush(10)

        grouped = BlockTiers(SPEC, remote_config(server.address), layers_per_page=2)  # no prefetch: RAM tier
        keys = grouped.keys(list(range(4 * BS)), "")
        assert grouped.promote(keys) == 3 and grouped.promoter.flush(10)
        ram = grouped.page_keys(keys, 1)
        assert grouped.chain.contains(ram, 0) == [True, True, True, False]
        before = grouped.chain.loads.get("remote", 0)
        dst = vllm_layers(fill=0.0)
        job = _job(grouped, dst, keys[:3], [5, 6, 7])
        job.run()
        assert job.failed == set() and grouped.chain.loads.get("remote", 0) == before  # none read again
        assert all(torch.equal(d[5:8], s[0:3]) for d, s in zip(dst, src, strict=True))

        whole = BlockTiers(SPEC, remote_config(server.address))  # whole blocks, a worker here: a prefetch
        whole.loads_here = True
        keys = whole.keys(list(range(4 * BS)), "")
        assert whole.promote(keys) == 3 and whole.promoted == 3
        dst = vllm_layers(fill=0.0)
        job = _job(whole, dst, keys[:3], [1, 2, 3])
        job.run()
        assert whole.prefetches_taken == 1 and job.failed == set()
        assert all(torch.equal(d[1:4], s[0:3]) for d, s in zip(dst, src, strict=True))

        assert whole.promote(whole.keys(list(range(100, 100 + 2 * BS)), "")) == 0  # held nowhere
        assert whole.promote(whole.keys(list(range(4 * BS)), "tenant-b")) == 0  # another namespace
