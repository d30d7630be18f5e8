"""The vLLM connector's vLLM-free parts: block layouts and the weights' identity."""

from __future__ import annotations

import pytest
import torch

from tiered_cache.integrations.vllm.identity import checkpoint_identity, model_id_for, vllm_spec
from tiered_cache.integrations.vllm.layout import gather_blocks, layout_of, scatter_blocks, stacked_view

LAYERS, HEADS, DIM, BS, BLOCKS = 3, 2, 8, 4, 10


def cpu_layers() -> list[torch.Tensor]:
    return [torch.randn(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]


def flash_layers() -> list[torch.Tensor]:
    return [torch.randn(2, BLOCKS, BS, HEADS, DIM) for _ in range(LAYERS)]


@pytest.mark.parametrize(("make", "kind"), [(cpu_layers, "cpu"), (flash_layers, "flash")])
def test_blocks_round_trip_through_pages_in_either_layout(make, kind):
    src, dst = make(), [torch.zeros_like(t) for t in make()]
    assert layout_of(src[0], HEADS, DIM) == kind
    pages = gather_blocks(src, [7, 2], kind, DIM)
    assert pages.shape == (2, LAYERS, 2, HEADS, BS, DIM)  # the HND staging shape of the spec
    spec = vllm_spec("m", LAYERS, HEADS, DIM, "float32", BS)
    assert pages.shape == spec.staging_shape(2)
    scatter_blocks(dst, [1, 5], list(pages), kind, DIM)
    for s, d in zip(src, dst, strict=True):
        pick = (lambda t, b: t[b]) if kind == "cpu" else (lambda t, b: t[:, b])
        assert torch.equal(pick(d, 1), pick(s, 7)) and torch.equal(pick(d, 5), pick(s, 2))
        assert not pick(d, 0).any()  # other blocks untouched


def one_tensor(kind: str) -> list[torch.Tensor]:
    """The layers as vLLM's CPU cache hands them out: slices of one allocation."""
    shape = (BLOCKS, HEADS, BS, 2 * DIM) if kind == "cpu" else (2, BLOCKS, BS, HEADS, DIM)
    return list(torch.zeros(LAYERS, *shape).unbind(0))


@pytest.mark.parametrize(("make", "kind"), [(cpu_layers, "cpu"), (flash_layers, "flash")])
def test_layers_sliced_from_one_tensor_take_one_copy_a_block_with_the_same_result(make, kind):
    src = make()
    pages = list(gather_blocks(src, [7, 2, 9], kind, DIM))
    apart, together = [torch.zeros_like(t) for t in src], one_tensor(kind)
    assert stacked_view(apart) is None and stacked_view(together) is not None
    scatter_blocks(apart, [1, 5, 3], pages, kind, DIM)
    scatter_blocks(together, [1, 5, 3], pages, kind, DIM)
    assert all(torch.equal(a, t) for a, t in zip(apart, together, strict=True))
    assert torch.equal(gather_blocks(together, [1, 5, 3], kind, DIM), torch.stack(pages))
    # A group of layers (a slice of them) is stacked too; out of order or unevenly spaced is not.
    assert stacked_view(together[1:]) is not None and stacked_view(together[:1]) is not None
    assert stacked_view([together[0], together[2], together[1]]) is None
    assert stacked_view([together[0], together[2]]) is not None  # evenly spaced: every other layer
    assert stacked_view([together[0], together[1], together[0]]) is None


def test_page_halves_are_k_then_v():
    layers = cpu_layers()
    page = gather_blocks(layers, [3], "cpu", DIM)[0]
    assert torch.equal(page[0, 0], layers[0][3][..., :DIM]) and torch.equal(page[0, 1], layers[0][3][..., DIM:])


def test_an_unknown_layout_is_an_error_naming_the_shape():
    with pytest.raises(ValueError, match=r"\(10, 2, 4, 8\)"):
        layout_of(torch.zeros(10, 2, 4, 8), HEADS, DIM)


def _save(folder, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(folder)


def test_checkpoints_of_equal_geometry_differ_and_copies_agree(tmp_path):
    import shutil

    _save(tmp_path / "base", 0)
    _save(tmp_path / "tuned", 1)
    shutil.copytree(tmp_path / "base", tmp_path / "elsewhere" / "base-copy")
    base, tuned = checkpoint_identity(tmp_path / "base"), checkpoint_identity(tmp_path / "tuned")
    assert base != tuned and checkpoint_identity(tmp_path / "elsewhere" / "base-copy") == base
    # The model id keys every page: different weights never share a block.
    spec = lambda folder: vllm_spec(model_id_for(str(folder), None), 2, 2, 8, "float32", 128)  # noqa: E731
    assert spec(tmp_path / "base").fingerprint != spec(tmp_path / "tuned").fingerprint
    assert spec(tmp_path / "base").fingerprint == spec(tmp_path / "elsewhere" / "base-copy").fingerprint
    assert model_id_for(str(tmp_path / "base"), None).startswith("llama@weights:")


def test_no_identity_is_an_error_not_a_guess(tmp_path):
    with pytest.raises(ValueError, match="model_id"):
        model_id_for("org/some-model", None)
    assert model_id_for("org/some-model", "abc123") == "org/some-model@abc123"
    assert model_id_for("anything", None, explicit="mine") == "mine"
    with pytest.raises(FileNotFoundError, match="safetensors"):
        checkpoint_identity(tmp_path)


def test_the_hook_timer_counts_time_in_a_classs_own_hooks_once_each():
    import time

    from tiered_cache.integrations.vllm.hook_timer import HookTimer

    class Base:
        def get_finished(self) -> str:  # inherited: left alone
            return "base"

    class Connector(Base):
        def start_load_kv(self) -> None:
            time.sleep(0.02)

        def wait_for_save(self) -> None:
            self.start_load_kv()  # a hook inside a hook: counted once, as the outer call

        def unrelated(self) -> None:
            time.sleep(0.02)

    timer = HookTimer()
    timer.install(Connector)
    timer.install(Connector)  # twice: still one wrapper
    c = Connector()
    assert "get_finished" not in Connector.__dict__ and c.get_finished() == "base"
    c.unrelated()
    assert timer.take() == (0.0, 0)
    c.start_load_kv()
    c.wait_for_save()
    seconds, calls = timer.take()
    assert calls == 2 and 0.04 <= seconds < 1.0
    assert timer.take() == (0.0, 0)
