"""The loading benchmark's quantized mode (issue 30): an FP8-block checkpoint as GLM-5-FP8 ships it, its bf16 twin,
and the report that sets their loads side by side.

`write_fp8_pair(directory)` writes a random Llama-shaped model of about 100M parameters (hidden 768, 12 layers,
every linear dim a multiple of 128, so transformers' FP8 loader can dequantize it too) twice:
- `fp8/`: as DeepSeek-V3 and GLM-5-FP8 ship their weights: `quantization_config` `{quant_method: fp8, fmt: e4m3,
  activation_scheme: dynamic, weight_block_size: [128, 128]}`, each linear weight of the decoder layers in e4m3
  with a float32 `weight_scale_inv` per 128 x 128 block, embeddings, norms and `lm_head` in bf16, in several
  safetensors files with an index;
- `bf16/`: the same model with each quantized weight replaced by the dequantization of its codes (codes x scale,
  in float32) saved as bfloat16, so both checkpoints hold the same values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

BLOCK = 128
FP8_MAX = 448.0
"""The largest finite e4m3 value: a block's largest weight maps onto it."""
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
MODEL_SHAPE = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=16384,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
"""About 101M parameters: 12 x 6.3M in the decoder layers' linears (quantized), 2 x 12.6M in the embedding and
`lm_head` (bf16)."""
SHARD_SIZE = "64MB"
MIB = 2**20


def write_fp8_pair(directory: Path, seed: int = 0, shape: dict = MODEL_SHAPE) -> tuple[Path, Path]:
    """Write the FP8-block checkpoint and its bf16 twin of `shape` (linear dims multiples of 128) under `directory`;
    their two paths."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape, dtype="bfloat16", architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    fp8, bf16 = {}, {}
    for name, param in skeleton.state_dict().items():
        if "norm" in name:
            bf16[name] = fp8[name] = torch.ones(param.shape, dtype=torch.bfloat16)
            continue
        weight = torch.randn(param.shape, generator=generator) * config.initializer_range
        if name.startswith("model.layers.") and weight.dim() == 2:
            codes, scale_inv = quantize_blocks(weight)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = codes, scale_inv
            bf16[name] = dequantize_blocks(codes, scale_inv).to(torch.bfloat16)
        else:  # the embedding and lm_head, unquantized as shipped
            bf16[name] = fp8[name] = weight.to(torch.bfloat16)
    tokenizer = _byte_tokenizer()
    paths = directory / "fp8", directory / "bf16"
    for path, state, quantization in ((paths[0], fp8, QUANTIZATION_CONFIG), (paths[1], bf16, None)):
        config.save_pretrained(path)
        tokenizer.save_pretrained(path)
        save_torch_state_dict(state, path, max_shard_size=SHARD_SIZE)
        if quantization:
            saved = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**saved, "quantization_config": quantization}, indent=2))
    return paths


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of a 2-D float32 weight (dims multiples of `BLOCK`) and its float32 `weight_scale_inv`, one per
    `BLOCK` x `BLOCK` block (the block's largest magnitude / 448)."""
    rows, cols = weight.shape
    assert rows % BLOCK == 0 and cols % BLOCK == 0, weight.shape
    blocks = weight.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    codes = (blocks / scale_inv[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return codes, scale_inv


def dequantize_blocks(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 weight that e4m3 `codes` and their block `scale_inv` stand for."""
    rows, cols = codes.shape
    blocks = codes.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    return (blocks * scale_inv[:, None, :, None]).reshape(rows, cols)


def _byte_tokenizer():
    """A small byte-level BPE tokenizer trained in-process (the benchmark only needs one that loads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["Sharded loading reads FP8 blocks and dequantizes them."] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>")


def disk_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.glob("*.safetensors"))


def report_fp8(figures: dict[str, list[dict]], fp8: Path, bf16: Path, world: int) -> None:
    """The three loads side by side (time, peak memory per rank, what the sharded loads read and hold), and the
    ratios the issue asks for."""
    params = _num_params(bf16)
    print(
        f"random Llama, {params / 1e6:.1f}M parameters, hidden {MODEL_SHAPE['hidden_size']}, "
        f"{MODEL_SHAPE['num_hidden_layers']} layers; FP8 checkpoint {disk_bytes(fp8) / MIB:.0f} MiB on disk "
        f"(e4m3 in {BLOCK}x{BLOCK} blocks + float32 weight_scale_inv; embeddings, norms, lm_head bf16), bf16 twin "
        f"{disk_bytes(bf16) / MIB:.0f} MiB; loaded as bfloat16; sharded on {world} ranks, 1 thread each"
    )
    print("times: best timed round; memory: above each rank's baseline after imports (private: the sampled round)")
    header = ("method", "ranks", "load s", "+1st token s", "peak anon MiB/rank", "peak RSS MiB/rank")
    print("{:<20} {:>5} {:>7} {:>13} {:>19} {:>18}".format(*header))
    for method, rows in figures.items():
        print(
            f"{method:<20} {len(rows):>5} {_max(rows, 'seconds'):>7.2f} {_max(rows, 'ready_seconds'):>13.2f} "
            f"{_max(rows, 'peak_anon') / MIB:>19.0f} {_max(rows, 'peak_rss') / MIB:>18.0f}"
        )
    print("what the sharded loads' summaries say:")
    for method, rows in figures.items():
        facts = rows[0]["facts"]
        if facts:
            quantized = ", ".join(f"{n} x {kind}" for kind, n in facts.get("quantized_tensors", {}).items()) or "none"
            print(
                f"  {method:<20} layout {facts['decode']}, checkpoint_bytes {facts['checkpoint_bytes'] / MIB:.0f} "
                f"MiB, local_param_bytes {max(facts['local_param_bytes']) / MIB:.0f} MiB per rank, "
                f"quantized_tensors: {quantized}"
            )
    print("where the time went (slowest rank of the best round, ms):")
    for method, rows in figures.items():
        slowest = max(rows, key=lambda row: row["seconds"])
        print(f"  {method:<20} " + ", ".join(f"{name} {1000 * s:.0f}" for name, s in slowest["parts"].items()))
    sharded, single, twin = (figures[name] for name in ("sharded-fp8", "from_pretrained-fp8", "sharded-bf16"))
    for key, what in (("seconds", "load time  "), ("peak_anon", "peak anon  "), ("peak_rss", "peak RSS   ")):
        print(
            f"{what} sharded-fp8 / from_pretrained-fp8 = {_max(sharded, key) / _max(single, key):.2f}   "
            f"sharded-fp8 / sharded-bf16 = {_max(sharded, key) / _max(twin, key):.2f}"
        )


def _max(rows: list[dict], key: str) -> float:
    return max(row[key] for row in rows)


def _num_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total
