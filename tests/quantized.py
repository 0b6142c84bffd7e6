"""Tiny quantized checkpoints written as the official ones ship, each with its float32 reference twin.

`write_quantized(source, target, fmt)` reads a float32 checkpoint (from `tests.tiny`), quantizes
the weights the real checkpoints quantize (names, dtypes, shapes and `quantization_config` as the
published files have them) and writes `target`; beside it, `target-reference` holds the same model
with every quantized weight replaced by the exact dequantization of its codes, computed here with
plain torch ops independently of shardbook's reader. Loading `target` must give the reference's
logits.

Formats (`FORMATS`):
- `fp8-blocks`: DeepSeek-V3 / Kimi-K2 / GLM-5-FP8 (`quant_method: fp8`, `weight_block_size`,
  float32 `weight_scale_inv` over a grid rounded up, so small dims end in partial blocks);
- `fp8-ue8m0`: DeepSeek-V3.1 and later (`scale_fmt: ue8m0`: power-of-two scales, stored as e8m0 bytes);
- `fp8-ue8m0-float32`: the same scales stored as float32 powers of two;
- `fp8-e5m2`: FP8 blocks with e5m2 codes;
- `fp8-tensor`: `quant_method: fp8` without `weight_block_size`, one scalar `weight_scale_inv` per tensor (shape [],
  as transformers' per-tensor `FP8Linear` holds it);
- `fp8-embedding`: FP8 blocks, and the embedding table in e4m3 with one `weight_scale` (shape [1], a multiplier), as
  transformers' `FP8Embedding` stores a `modules_to_convert` table;
- `fp8-minimax`: MiniMax-M2 (`modules_to_not_convert`: router gate, score bias and lm_head unquantized);
- `mxfp4`: gpt-oss (experts as `_blocks` / `_scales`, stored out x in);
- `int4-pack`: Kimi-K2-Thinking (compressed-tensors pack-quantized int4, group 32, routed experts only);
- `int8-pack`: llm-compressor's W8A16 (pack-quantized int8 in groups, every linear but lm_head);
- `fp8-channel`, `fp8-float-tensor`, `fp8-float-group`, `fp8-float-block`: llm-compressor's float-quantized FP8,
  one bf16 `weight_scale` per output channel, per tensor, per group of a row or per block, in the shapes
  compressed-tensors gives them ([rows, 1], [1], [rows, ceil(cols / group)], ceil(shape / block));
- `deepseek-v4`: DeepSeek-V4's FP4 experts over FP8-block linears, every scale an e8m0 `.scale`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
BLOCK = 32
"""The test checkpoints' FP8 block: the tiny models' dims (24, 80, ...) end in partial blocks as the real
[576, 7168] `kv_a_proj_with_mqa` does in 128 x 128 blocks."""

UNQUANTIZED = ("embed", "lm_head", "norm", ".gate.", "router", "bias", "sinks", "indexer", "hc_", "position")


def write_quantized(source: Path, target: Path, fmt: str, **settings) -> tuple[Path, Path]:
    """Write `source` (a float32 checkpoint) to `target` in `fmt`, and its dequantized twin; both paths."""
    from safetensors.torch import load_file, save_file

    state = {}
    for file in sorted(Path(source).glob("*.safetensors")):
        state.update(load_file(file))
    stored, reference = FORMATS[fmt](state, **settings)
    config = json.loads((Path(source) / "config.json").read_text())
    twin = target.with_name(target.name + "-reference")
    for directory, tensors, quantization in ((target, stored, QUANTIZATION[fmt]), (twin, reference, None)):
        shutil.copytree(source, directory, ignore=shutil.ignore_patterns("*.safetensors*"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
        written = dict(config, **({"quantization_config": quantization(settings)} if quantization else {}))
        (directory / "config.json").write_text(json.dumps(written, indent=2))
    return target, twin


def _unquantized(name: str) -> bool:
    return any(part in name for part in UNQUANTIZED)


def _linear(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() >= 2 and name.endswith(".weight") and not _unquantized(name)


def block_amax(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest |value| of each `block` of a 2-D weight, over a grid rounded up (partial last blocks)."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight
    return padded.reshape(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3))


def fp8_blocks(
    weight: torch.Tensor, block: int, power_of_two: bool = False, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes (e4m3 unless `dtype` says) and float32 `weight_scale_inv` per `block` x `block` (grid rounded up)
    of a 2-D weight."""
    scale = block_amax(weight, (block, block)).clamp(min=1e-8) / torch.finfo(dtype).max
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = (weight / expand_blocks(scale, (block, block), weight.shape)).to(dtype)
    return codes, scale


def expand_blocks(scale: torch.Tensor, block: tuple[int, ...], shape) -> torch.Tensor:
    """Each element's scale: the grid repeated `block` times per dim, cut to `shape`."""
    for dim, size in enumerate(block):
        scale = scale.repeat_interleave(size, dim=dim)
    return scale[tuple(slice(0, n) for n in shape)]


def _fp8(
    state: dict,
    block: int | None = BLOCK,
    power_of_two: bool = False,
    keep=(),
    dtype: torch.dtype = torch.float8_e4m3fn,
    e8m0_bytes: bool = True,
) -> tuple[dict, dict]:
    """Fine-grained FP8 of every linear but `keep`'s; power-of-two scales are stored as e8m0 bytes unless not
    `e8m0_bytes` (then float32, as DeepSeek-V3.1 stores them)."""
    stored, reference = {}, {}
    for name, tensor in state.items():
        if not _linear(name, tensor) or any(re.search(pattern, name) for pattern in keep) or tensor.dim() != 2:
            stored[name] = reference[name] = tensor
            continue
        if block is None:
            codes, inv = fp8_per_tensor(tensor)
            inv = inv.reshape(())
            reference[name] = codes.float() * inv
        else:
            codes, inv = fp8_blocks(tensor, block, power_of_two, dtype)
            reference[name] = codes.float() * expand_blocks(inv, (block, block), tensor.shape)
            if power_of_two and e8m0_bytes:
                inv = inv.to(torch.float8_e8m0fnu)
        stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = codes, inv
    return stored, reference


def fp8_per_tensor(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of `tensor` and its one float32 scale, shape [1] (value = code x scale)."""
    scale = (tensor.abs().amax().clamp(min=1e-8) / FP8_MAX).reshape(1)
    return (tensor / scale).to(torch.float8_e4m3fn), scale


def _fp8_embedding(state: dict) -> tuple[dict, dict]:
    """FP8 blocks, and the embedding table in e4m3 with one `weight_scale` (a multiplier, shape [1]), as
    transformers' `FP8Embedding` stores a table named in `modules_to_convert`."""
    stored, reference = _fp8(state)
    name = next(n for n in state if n.endswith("embed_tokens.weight"))
    codes, scale = fp8_per_tensor(state[name])
    stored[name], stored[name.removesuffix("weight") + "weight_scale"] = codes, scale
    reference[name] = codes.float() * scale
    return stored, reference


def _fp8_minimax(state: dict) -> tuple[dict, dict]:
    return _fp8(state, keep=MINIMAX_NOT_CONVERTED)


MINIMAX_NOT_CONVERTED = (r"\.gate\.weight$", r"e_score_correction_bias", r"^lm_head")


GROUP = 32
"""The compressed-tensors test checkpoints' group size (and rows x columns of a block): the tiny Llama's 80 columns
end in a partial group, as compressed-tensors allows (with a warning) when a group does not divide a row."""


def strategy_block(strategy: str, shape: tuple[int, int]) -> tuple[int, int]:
    """Rows x columns one compressed-tensors scale covers, by the scheme's strategy."""
    blocks = {"tensor": tuple(shape), "channel": (1, shape[1]), "group": (1, GROUP), "block": (GROUP, GROUP)}
    return blocks[strategy]


def _fp8_float(state: dict, strategy: str) -> tuple[dict, dict]:
    """llm-compressor's float-quantized FP8: e4m3 `weight` and a bf16 `weight_scale` per `strategy`."""
    stored, reference = {}, {}
    for name, tensor in state.items():
        if not _linear(name, tensor) or tensor.dim() != 2:
            stored[name] = reference[name] = tensor
            continue
        block = strategy_block(strategy, tensor.shape)
        scale = (block_amax(tensor, block) / FP8_MAX).clamp(min=1e-8).to(torch.bfloat16)
        each = expand_blocks(scale.float(), block, tensor.shape)
        codes = (tensor / each).to(torch.float8_e4m3fn)
        stored[name], stored[name + "_scale"] = codes, scale.reshape(1) if strategy == "tensor" else scale
        reference[name] = codes.float() * each
    return stored, reference


def e2m1_blocks(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 of `values` (last dim a multiple of 32): packed codes [..., n/32, 16], e8m0 scale bytes, dequantized."""
    *lead, width = values.shape
    groups = values.reshape(*lead, width // 32, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)
    code = (scaled.unsqueeze(-1) - E2M1).abs().argmin(dim=-1)  # the nearest e2m1 value
    dequantized = E2M1[code] * torch.exp2(exponent)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    scales = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return packed, scales, dequantized.reshape(values.shape)


def _mxfp4(state: dict) -> tuple[dict, dict]:
    stored, reference = {}, {}
    for name, tensor in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name] = reference[name] = tensor
            continue
        packed, scales, dequantized = e2m1_blocks(tensor.transpose(1, 2))  # stored out x in
        stored[name + "_blocks"], stored[name + "_scales"] = packed, scales
        reference[name] = dequantized.transpose(1, 2)
    return stored, reference


def pack_ints(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed `bits`-bit codes [rows, cols] as compressed-tensors packs them: + 2^(bits - 1), 32 / bits a word, low
    bits first."""
    rows, cols = codes.shape
    per_word = 32 // bits
    unsigned = (codes.to(torch.int64) + (1 << (bits - 1))).reshape(rows, cols // per_word, per_word)
    words = sum(unsigned[..., i] << (bits * i) for i in range(per_word))
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same 32 bits, as a signed word


def _int_pack(state: dict, bits: int, quantized, group: int = 32) -> tuple[dict, dict]:
    """compressed-tensors pack-quantized, symmetric, a bf16 scale per `group` of a row, of the weights `quantized`
    (name, tensor) selects; a last group may be partial."""
    stored, reference = {}, {}
    largest = (1 << (bits - 1)) - 1
    for name, tensor in state.items():
        if not quantized(name, tensor):
            stored[name] = reference[name] = tensor
            continue
        scale = (block_amax(tensor, (1, group)) / largest).clamp(min=1e-8).to(torch.bfloat16)
        each = expand_blocks(scale.float(), (1, group), tensor.shape)
        codes = torch.clamp(torch.round(tensor / each), -largest - 1, largest)
        module = name.removesuffix(".weight")
        stored[f"{module}.weight_packed"] = pack_ints(codes, bits)
        stored[f"{module}.weight_scale"] = scale
        stored[f"{module}.weight_shape"] = torch.tensor(tensor.shape, dtype=torch.int32)
        reference[name] = codes * each
    return stored, reference


def _routed_expert(name: str, tensor: torch.Tensor) -> bool:
    """Kimi-K2-Thinking quantizes its routed experts only."""
    return re.search(r"\.experts\.\d+\..*\.weight$", name) is not None


def _linear_2d(name: str, tensor: torch.Tensor) -> bool:
    return _linear(name, tensor) and tensor.dim() == 2


def _deepseek_v4(state: dict) -> tuple[dict, dict]:
    """FP4 routed experts (int8 bytes of two e2m1 values, an e8m0 `.scale` per 32 of a row) over fp8-block linears
    with power-of-two `.scale`s, as DeepSeek-V4 names them."""
    stored, reference = {}, {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if re.search(r"\.experts\.\d+\.w[123]\.weight$", name):
            packed, scales, reference[name] = e2m1_blocks(tensor)
            stored[name] = packed.reshape(tensor.shape[0], -1).view(torch.int8)
            stored[f"{module}.scale"] = scales.view(torch.float8_e8m0fnu)
        elif _linear(name, tensor) and tensor.dim() == 2:
            codes, inv = fp8_blocks(tensor, BLOCK, power_of_two=True)
            reference[name] = codes.float() * expand_blocks(inv, (BLOCK, BLOCK), tensor.shape)
            stored[name], stored[f"{module}.scale"] = codes, inv.to(torch.float8_e8m0fnu)
        else:
            stored[name] = reference[name] = tensor
    return stored, reference


FORMATS = {
    "fp8-blocks": _fp8,
    "fp8-ue8m0": lambda state: _fp8(state, power_of_two=True),
    "fp8-ue8m0-float32": lambda state: _fp8(state, power_of_two=True, e8m0_bytes=False),
    "fp8-e5m2": lambda state: _fp8(state, dtype=torch.float8_e5m2),
    "fp8-tensor": lambda state: _fp8(state, block=None),
    "fp8-minimax": _fp8_minimax,
    "fp8-embedding": _fp8_embedding,
    "fp8-channel": lambda state: _fp8_float(state, "channel"),
    "fp8-float-tensor": lambda state: _fp8_float(state, "tensor"),
    "fp8-float-group": lambda state: _fp8_float(state, "group"),
    "fp8-float-block": lambda state: _fp8_float(state, "block"),
    "mxfp4": _mxfp4,
    "int4-pack": lambda state: _int_pack(state, 4, _routed_expert),
    "int8-pack": lambda state: _int_pack(state, 8, _linear_2d, group=GROUP),
    "deepseek-v4": _deepseek_v4,
}

_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
QUANTIZATION = {
    "fp8-blocks": lambda s: {**_FP8, "weight_block_size": [BLOCK, BLOCK]},
    "fp8-ue8m0": lambda s: {**_FP8, "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"},
    "fp8-ue8m0-float32": lambda s: {**_FP8, "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"},
    "fp8-e5m2": lambda s: {**_FP8, "fmt": "e5m2", "weight_block_size": [BLOCK, BLOCK]},
    "fp8-tensor": lambda s: {**_FP8, "weight_block_size": None},
    "fp8-embedding": lambda s: {**_FP8, "weight_block_size": [BLOCK, BLOCK], "modules_to_convert": ["embed_tokens"]},
    "fp8-minimax": lambda s: {
        **_FP8,
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
    },
    "fp8-channel": lambda s: _float_quantized("channel"),
    "fp8-float-tensor": lambda s: _float_quantized("tensor"),
    "fp8-float-group": lambda s: _float_quantized("group", group_size=GROUP),
    "fp8-float-block": lambda s: _float_quantized("block", block_structure=[GROUP, GROUP]),
    "mxfp4": lambda s: {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
    "deepseek-v4": lambda s: {
        **_FP8,
        "weight_block_size": [BLOCK, BLOCK],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    },
    "int4-pack": lambda s: _compressed(
        "pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    ),
    "int8-pack": lambda s: _compressed(
        "pack-quantized", {"num_bits": 8, "type": "int", "strategy": "group", "group_size": GROUP}
    ),
}


def _float_quantized(strategy: str, **arguments) -> dict:
    return _compressed("float-quantized", {"num_bits": 8, "type": "float", "strategy": strategy, **arguments})


def _compressed(form: str, weights: dict) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": form,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"symmetric": True, "dynamic": False, "actorder": None, **weights},
                "input_activations": None,
                "output_activations": None,
                "format": form,
            }
        },
        "ignore": ["lm_head"],
    }
