"""The GPU check's ``fp8 kept`` and ``fp8 kept experts`` rows (without and with ``--moe``): an FP8-block checkpoint
loaded with ``model.fp8_weights keep`` and with ``dequantize``, side by side: the weight bytes held, the device
memory in use after the load, greedy decode tok/s and how far the kept model's logits are from the dequantized
one's.

    python3 bench/gpu_fp8.py --device cuda           # the 100M FP8 Llama of bench/load_fp8.py, in bf16
    python3 bench/gpu_fp8.py --device cuda --moe     # a 110M FP8 Qwen3-MoE: routed experts kept too
    .venv/bin/python bench/gpu_fp8.py --device cpu   # a tiny one, keep-reference (a CPU has no FP8 matmul)

One rank (a one-rank process group), the `tp` layout; each mode prints one JSON line. On a CPU `keep` would
dequantize (with a warning), so the CPU run keeps with `keep-reference`: it checks the path, not its speed.
With `--moe` the checkpoint is a mixture of experts stored as Qwen3-*-FP8 ships it (each routed expert's
gate, up and down in e4m3 128 x 128 blocks, the routers unquantized), where nearly all the weight bytes are
the experts'.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_fp8 import MODEL_SHAPE, QUANTIZATION_CONFIG, quantize_blocks, write_fp8_pair

DRY_SHAPE = dict(MODEL_SHAPE, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
DRY_SHAPE.update(num_key_value_heads=2, vocab_size=512)
"""Every linear dim a multiple of 128, as the kernel wants; small enough for CI's CPU."""
MOE_SHAPE = dict(
    num_layers=4,
    hidden_size=1024,
    num_heads=8,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=1024,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    norm_topk_prob=True,
)
"""A Qwen3-MoE of about 110M parameters, 100M of them in the routed experts (4 layers x 16 x 3 x 1024 x 512);
every linear dim a multiple of 128."""
DRY_MOE_SHAPE = dict(MOE_SHAPE, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64)
DRY_MOE_SHAPE.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=32, help="greedy decode steps timed per mode")
    p.add_argument("--moe", action="store_true", help="a mixture-of-experts checkpoint instead of the dense Llama")
    args = p.parse_args()
    from shardbook.rankd.control.world import init_world

    device = torch.device(init_world(args.device).device)
    cpu = device.type == "cpu"
    with tempfile.TemporaryDirectory(prefix="gpu-fp8-") as tmp:
        if args.moe:
            fp8 = write_fp8_moe(Path(tmp), DRY_MOE_SHAPE if cpu else MOE_SHAPE)
        else:
            fp8, _ = write_fp8_pair(Path(tmp), shape=DRY_SHAPE if cpu else MODEL_SHAPE)
        kept_mode = "keep-reference" if cpu else "keep"
        reference = None
        for mode in ("dequantize", kept_mode):
            figures, logits = measure(fp8, mode, device, "float32" if cpu else "bfloat16", args.tokens)
            if reference is None:
                reference = logits
            figures["logits_max_diff"] = float((logits - reference).abs().max())
            figures["logits_max"] = float(reference.abs().max())
            print(json.dumps(figures), flush=True)
    return 0


def measure(path: Path, mode: str, device: torch.device, dtype: str, tokens: int) -> tuple[dict, torch.Tensor]:
    """Load `path` with `model.fp8_weights mode`; its figures and its first step's logits (float32, on the CPU)."""
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import free_model, load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype=dtype, fp8_weights=mode),
        parallel=ParallelConfig(decode="tp"),
    )
    loaded = load_sharded(config, device=device)
    summary = loaded.summary
    held = summary["local_param_bytes"][0] + summary.get("fp8_scale_bytes", 0)
    in_use = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    logits, tok_s = decode(loaded.model, loaded.tokenizer, device, tokens)
    figures = {
        "mode": mode,
        "fp8_kept_modules": summary.get("fp8_kept_modules", 0),
        "fp8_kernel_modules": summary.get("fp8_kernel_modules", 0),
        "fp8_kept_experts": summary.get("fp8_kept_experts", 0),
        "fp8_kernel_experts": summary.get("fp8_kernel_experts", 0),
        "held_weight_bytes": held,
        "device_bytes": in_use,
        "decode_tok_s": tok_s,
        "note": summary.get("fp8_weights", ""),
    }
    free_model({"model": loaded.model}, device=device)
    return figures, logits


def write_fp8_moe(directory: Path, shape: dict) -> Path:
    """A random Qwen3-MoE of `shape` written as its FP8 releases ship: every linear of the layers, each routed
    expert's included, in e4m3 with a float32 `weight_scale_inv` per 128 x 128 block; the routers (`mlp.gate`),
    norms, embeddings and lm_head as saved. Its path."""
    import shutil

    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tiny import make_tiny_lm

    source = make_tiny_lm(directory / "float32", family="qwen3_moe", **shape)  # experts stored one by one
    target = shutil.copytree(source, directory / "fp8", ignore=shutil.ignore_patterns("*.safetensors*"))
    stored = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name.startswith("model.layers.") and tensor.dim() == 2 and not name.endswith("mlp.gate.weight"):
                stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = quantize_blocks(tensor)
            else:
                stored[name] = tensor
    save_file(stored, target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}, indent=2))
    return target


@torch.no_grad()
def decode(model, tokenizer, device: torch.device, tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy decoding of one sequence with its KV cache: the prefill's last logits, and decode tok/s."""
    from transformers import DynamicCache

    from shardbook.rankd.generation.cache_keyword import cache_keyword

    cache = {cache_keyword(model): DynamicCache(config=model.config)}  # filled in place by each forward
    ids = tokenizer("Sharded FP8 weights decode", return_tensors="pt")["input_ids"].to(device)
    logits = model(input_ids=ids, use_cache=True, **cache).logits
    first = logits[0, -1].float().cpu()
    sync(device)
    start = time.perf_counter()
    for _ in range(tokens):
        logits = model(input_ids=logits[:, -1:].argmax(-1), use_cache=True, **cache).logits
    sync(device)
    return first, tokens / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
