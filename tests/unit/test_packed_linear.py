"""bfloat16 linears through oneDNN's packed weights (rankd/parallel/packed_linear.py): the same logits as
`F.linear`, a weight changed any way is packed again, gradients and other dtypes take `F.linear`. One process, a
tiny random Llama; the packing tests need a CPU with AMX or AVX512-BF16 (skipped elsewhere, where nothing packs)."""

from __future__ import annotations

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import make_tiny_llama

from shardbook.rankd.control.dispatch import forget_packed_weights
from shardbook.rankd.parallel import packed_linear
from shardbook.rankd.parallel.packed_linear import PackedLinear, pack_linears, packing_available

needs_bf16_kernels = pytest.mark.skipif(
    not packing_available(), reason="needs a CPU with AMX or AVX512-BF16 (nothing is packed on this one)"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("packed") / "llama", hidden_size=128)


def loaded(path: Path, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(10, 200, (3, 12), generator=torch.Generator().manual_seed(0))


@needs_bf16_kernels
def test_every_linear_is_packed_and_the_logits_are_the_same_bits(tiny):
    plain, model = loaded(tiny), loaded(tiny)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert pack_linears(model) == linears > 0
    assert all(type(m) is PackedLinear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert torch.equal(logits(model, IDS), logits(plain, IDS))


@needs_bf16_kernels
@pytest.mark.parametrize("edit", ["in place", "new data", "through .data, then forgotten"])
def test_a_changed_weight_is_packed_again(tiny, edit):
    plain, model = loaded(tiny), loaded(tiny)
    pack_linears(model)
    before = logits(model, IDS)
    for m in (plain, model):
        weight = m.model.layers[0].mlp.down_proj.weight
        if edit == "in place":
            with torch.no_grad():
                weight.mul_(-3)
        elif edit == "new data":
            weight.data = weight.data * -3
        else:
            weight.data.mul_(-3)
    if edit == "through .data, then forgotten":
        forget_packed_weights()  # what a notebook cell's start and end, and a follower's %%all, do
    after = logits(model, IDS)
    assert not torch.equal(after, before)
    assert torch.equal(after, logits(plain, IDS))


@needs_bf16_kernels
def test_gradients_flow_as_through_f_linear(tiny):
    plain, model = loaded(tiny), loaded(tiny)
    pack_linears(model)
    for m in (plain, model):
        m(IDS).logits.float().square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=0, rtol=0, msg=name)


@needs_bf16_kernels
def test_a_packed_model_deep_copies_saves_and_lets_its_copies_go(tiny, tmp_path):
    gc.collect()  # earlier tests' models, and so their copies, go
    model = loaded(tiny)
    pack_linears(model)
    logits(model, IDS)
    held = len(packed_linear._packed)
    twin = copy.deepcopy(model)
    assert torch.equal(logits(twin, IDS), logits(model, IDS))
    assert len(packed_linear._packed) == 2 * held  # the copy's weights are packed at their first use
    twin.save_pretrained(tmp_path / "saved")
    assert torch.equal(logits(loaded(tmp_path / "saved"), IDS), logits(model, IDS))
    del twin
    gc.collect()
    assert len(packed_linear._packed) == held


def test_float32_and_a_switched_off_process_are_not_packed(tiny, monkeypatch):
    assert pack_linears(loaded(tiny, torch.float32)) == 0
    monkeypatch.setenv(packed_linear.SWITCH, "0")
    packing_available.cache_clear()
    try:
        model = loaded(tiny)
        assert pack_linears(model) == 0
        assert not any(type(m) is PackedLinear for m in model.modules())
    finally:
        monkeypatch.undo()
        packing_available.cache_clear()
