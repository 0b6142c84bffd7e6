"""FP8 block weights kept as FP8 (`model.fp8_weights keep`), in one process: a layer holding any rank's slice of the
codes computes the dequantized weight's matmul, whatever the slice's boundaries inside blocks, and so does each
routed expert of a fused experts module holding some experts' slices.

The multi-process tests (tests/multiproc/test_fp8_keep.py) load whole checkpoints this way on 2 ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardbook.rankd.loading.checkpoint_names import ExpertStack
from shardbook.rankd.loading.fp8_keep import FP8Keeping, fp8_keeping, require_keep_layout
from shardbook.rankd.loading.quantized_formats import dequantizing_index
from shardbook.rankd.loading.safetensors_files import read_index
from shardbook.rankd.parallel import fp8_linear
from shardbook.rankd.parallel.expert_parallel import ExpertParallel
from shardbook.rankd.parallel.fp8_experts import FP8Experts, keep_fp8_experts, kept_values
from shardbook.rankd.parallel.fp8_linear import FP8Linear, dequantized, kernel_matmul, reference_matmul
from tests.quantized import BLOCK, expand_blocks, fp8_blocks

CPU = torch.device("cpu")
FP8_CONFIG = SimpleNamespace(
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
)


@pytest.fixture(scope="module")
def stored_weight(tmp_path_factory):
    """A [70, 90] weight in 32 x 32 blocks (partial last blocks both ways), its stored entry and its dequantization."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    weight = torch.randn(70, 90) * 0.02
    codes, inv = fp8_blocks(weight, BLOCK)
    path = tmp_path_factory.mktemp("fp8")
    save_file({"layer.weight": codes, "layer.weight_scale_inv": inv}, path / "model.safetensors")
    stored = dequantizing_index(read_index(path), FP8_CONFIG)["layer.weight"]
    return stored, codes.float() * expand_blocks(inv, (BLOCK, BLOCK), weight.shape)


SELECTIONS = {
    "whole": (None, None),
    "rows inside blocks (colwise tp)": ((range(7, 45),), None),
    "rows in two ranges (shared kv rows)": ((range(10), range(40, 50)), None),
    "columns inside blocks (rowwise tp)": (None, (range(20, 77),)),
    "columns from a block boundary": (None, (range(32, 90),)),
}


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_a_kept_slice_computes_the_dequantized_matmul(stored_weight, monkeypatch, selection):
    monkeypatch.setattr(fp8_linear, "PIECE_ELEMENTS", 200)  # a few rows at a time: pieces end mid-block
    stored, values = stored_weight
    rows, columns = SELECTIONS[selection]
    want = values
    if rows is not None:
        want = torch.cat([want[r.start : r.stop] for r in rows])
    if columns is not None:
        want = want[:, columns[0].start : columns[0].stop]
    layer = nn.Linear(want.shape[1], want.shape[0], bias=True)
    codes = FP8Keeping(kernel=False).keep(layer, "layer.weight", stored, (rows, columns), CPU)
    layer.weight = nn.Parameter(codes, requires_grad=False)
    assert isinstance(layer, FP8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight.shape == want.shape  # the codes of exactly the held slice
    assert torch.equal(dequantized(layer), want)
    x = torch.randn(3, 4, want.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ want.T + layer.bias, rtol=1e-5, atol=1e-6)


def test_the_reference_path_passes_gradients_to_its_input(stored_weight):
    stored, values = stored_weight
    layer = nn.Linear(90, 70, bias=False)
    layer.weight = nn.Parameter(FP8Keeping(kernel=False).keep(layer, "w", stored, (None, None), CPU), False)
    x = torch.randn(2, 90, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, values.sum(0).expand(2, -1), rtol=1e-5, atol=1e-6)


def test_columns_in_two_ranges_are_refused(stored_weight):
    with pytest.raises(ValueError, match="one range of columns per rank.*fp8_weights dequantize"):
        FP8Keeping(kernel=False).keep(nn.Linear(20, 70), "w", stored_weight[0], (None, (range(10), range(50, 60))), CPU)


def test_each_choice_says_what_happens_on_a_cpu(caplog):
    assert fp8_keeping("dequantize", FP8_CONFIG, CPU) == (None, "")
    keeping, note = fp8_keeping("keep-reference", FP8_CONFIG, CPU)
    assert keeping is not None and not keeping.kernel and "reference path" in note
    keeping, note = fp8_keeping("keep", FP8_CONFIG, CPU)  # no FP8 matmul on a CPU: overridden, with a warning
    assert keeping is None and "cpu devices have no FP8 matmul" in note and "dequantized" in note
    assert note in caplog.text
    unquantized = SimpleNamespace(quantization_config=None)
    assert fp8_keeping("keep-reference", unquantized, CPU)[0] is None  # nothing to keep
    with pytest.raises(ValueError, match="parallel.decode tp only.*parallel.decode is gather"):
        require_keep_layout(FP8Keeping(kernel=False), "gather")
    with pytest.raises(ValueError, match="which this model cannot use \\(no plan\\); set model.fp8_weights dequantize"):
        require_keep_layout(FP8Keeping(kernel=False), "tp", "no plan")
    require_keep_layout(None, "gather", "no plan")  # nothing kept: any layout


@pytest.mark.parametrize("tokens", [1, 10])
def test_the_kernel_call_passes_torchs_shape_and_stride_checks(tokens):
    """On the meta device torch runs scaled_mm's own checks of the 1 x 128 scales (shapes, column-major strides),
    the ones a GPU run would fail on; one token is decode's case."""
    codes = torch.empty(256, 512, device="meta", dtype=torch.float8_e4m3fn)
    scales = fp8_linear.column_major(torch.empty(256, 4, device="meta"))
    x = torch.empty(2, tokens, 512, device="meta", dtype=torch.bfloat16)
    assert kernel_matmul(x, codes, scales).shape == (2, tokens, 256)
    with pytest.raises(RuntimeError, match="1x128 x 1x128 blockwise scaling"):
        kernel_matmul(x, codes, torch.empty(256, 4, device="meta"))  # row-major weight scales


def test_one_experts_kernel_scales_pass_torchs_checks():
    """Kept experts' scales [experts, N, K / 128] are stored so that each expert's own are column-major."""
    codes = torch.empty(3, 256, 512, device="meta", dtype=torch.float8_e4m3fn)
    scales = fp8_linear.column_major(torch.empty(3, 256, 4, device="meta"))
    x = torch.empty(1, 512, device="meta", dtype=torch.bfloat16)
    assert kernel_matmul(x, codes[2], scales[2]).shape == (1, 256)


@pytest.mark.gpu
def test_the_kernel_agrees_with_the_reference_path():
    """torch's blockwise FP8 matmul (activations quantized to e4m3 too) against the exact reference."""
    if not torch.cuda.is_available() or fp8_linear.kernel_unavailable(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU of compute capability 8.9 or higher")
    torch.manual_seed(0)
    weight = torch.randn(256, 512) * 0.02
    codes, inv = fp8_blocks(weight, 128)
    scales = inv.repeat_interleave(128, dim=0).cuda()  # per row, 1 x 128
    codes = codes.cuda()
    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    want = reference_matmul(x.float(), codes, scales, 0, 128)
    got = kernel_matmul(x, codes, fp8_linear.column_major(scales)).float()
    torch.testing.assert_close(got, want, rtol=0.1, atol=0.02 * want.abs().max().item())


@pytest.fixture(scope="module")
def stored_experts(tmp_path_factory):
    """Three experts' gate, up [40, 70] and down [70, 40] in 32 x 32 blocks, as fused `ExpertStack`s (gate_up_proj,
    down_proj) over the stored per-expert tensors, and the dequantized fused tensors."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    tensors, values = {}, {"gate": [], "up": [], "down": []}
    for expert in range(3):
        for part, shape in (("gate", (40, 70)), ("up", (40, 70)), ("down", (70, 40))):
            codes, inv = fp8_blocks(torch.randn(shape) * 0.02, BLOCK)
            tensors[f"experts.{expert}.{part}.weight"], tensors[f"experts.{expert}.{part}.weight_scale_inv"] = (
                codes,
                inv,
            )
            values[part].append(codes.float() * expand_blocks(inv, (BLOCK, BLOCK), shape))
    path = tmp_path_factory.mktemp("fp8-experts")
    save_file(tensors, path / "model.safetensors")
    index = dequantizing_index(read_index(path), FP8_CONFIG)
    parts = {part: tuple(index[f"experts.{e}.{part}.weight"] for e in range(3)) for part in values}
    stacks = {
        "gate_up_proj": ExpertStack(parts=(parts["gate"], parts["up"]), concat_dim=1),
        "down_proj": ExpertStack(parts=(parts["down"],), concat_dim=None),
    }
    wanted = {
        "gate_up_proj": torch.cat([torch.stack(values["gate"]), torch.stack(values["up"])], dim=1),
        "down_proj": torch.stack(values["down"]),
    }
    return stacks, wanted


class _Experts(ExpertParallel, nn.Module):
    """An expert-parallel experts module, without the process group its forward would sum over."""


EXPERT_SELECTIONS = {
    # rows of gate and of up starting inside a block, as an ep_fsdp slice has them; down's columns likewise
    "gate_up_proj": ((range(1, 3),), (range(5, 20), range(45, 60)), None),
    "down_proj": ((range(1, 3),), None, (range(13, 40),)),
}


@pytest.mark.parametrize("weight", list(EXPERT_SELECTIONS))
def test_kept_experts_compute_each_experts_dequantized_matmul(stored_experts, monkeypatch, weight):
    monkeypatch.setattr(fp8_linear, "PIECE_ELEMENTS", 200)  # a few rows of one expert at a time
    stacks, wanted = stored_experts
    experts_kept, rows, columns = EXPERT_SELECTIONS[weight]
    want = wanted[weight][1:3]
    if rows is not None:
        want = torch.cat([want[:, r.start : r.stop] for r in rows], dim=1)
    if columns is not None:
        want = want[:, :, columns[0].start : columns[0].stop]
    module = _Experts()
    codes = FP8Keeping(kernel=False).keep(
        module, f"mlp.experts.{weight}", stacks[weight], EXPERT_SELECTIONS[weight], CPU
    )
    setattr(module, weight, nn.Parameter(codes, requires_grad=False))
    assert isinstance(module, FP8Experts) and codes.dtype == torch.float8_e4m3fn and codes.shape == want.shape
    scales = getattr(module, weight + "_scale_inv")  # per expert, row and column block touched: all that is held
    assert scales.shape == (2, want.shape[1], 3 if columns is None else 2) and scales.dtype == torch.float32
    assert torch.equal(kept_values(module, getattr(module, weight)), want)
    x = torch.randn(4, want.shape[2])
    for expert in range(2):
        torch.testing.assert_close(module.expert_matmul(x, weight, expert), x @ want[expert].T, rtol=1e-5, atol=1e-6)


def test_experts_with_one_weight_kept_compute_the_other_as_stored(stored_experts):
    stacks, wanted = stored_experts
    module = _Experts()
    module.gate_up_proj = nn.Parameter(
        FP8Keeping(kernel=False).keep(module, "gate_up_proj", stacks["gate_up_proj"], (None, None, None), CPU), False
    )
    module.down_proj = nn.Parameter(wanted["down_proj"], requires_grad=False)
    x = torch.randn(4, 40)
    torch.testing.assert_close(module.expert_matmul(x, "down_proj", 2), x @ wanted["down_proj"][2].T)
    assert kept_values(module, module.down_proj) is None  # not kept: full_parameter shows it as held


@pytest.mark.gpu
def test_kept_experts_by_the_kernel_agree_with_the_reference_path():
    """Each expert's matmul by torch's blockwise FP8 matmul, from the stacked codes and column-major scales."""
    if not torch.cuda.is_available() or fp8_linear.kernel_unavailable(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU where torch's blockwise FP8 matmul runs")
    torch.manual_seed(0)
    blocks = [fp8_blocks(torch.randn(256, 512) * 0.02, 128) for _ in range(3)]
    codes = torch.stack([c for c, _ in blocks]).cuda()
    scales = torch.stack([inv.repeat_interleave(128, dim=0) for _, inv in blocks]).cuda()  # per row, 1 x 128
    module = _Experts()
    keep_fp8_experts(module, "down_proj", scales, 0, 128, kernel=True)
    module.down_proj = nn.Parameter(codes, requires_grad=False)
    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    for expert in range(3):
        want = reference_matmul(x.float(), codes[expert], scales[expert], 0, 128)
        got = module.expert_matmul(x, "down_proj", expert).float()
        torch.testing.assert_close(got, want, rtol=0.1, atol=0.02 * want.abs().max().item())
