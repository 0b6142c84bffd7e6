"""Activation patching (`%patch`) on 2 gloo ranks equals the same sweep in one process; attribution patching
equals its first-order formula."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny import make_tiny_lm, make_tiny_moe

CLEAN, CORRUPT = "The capital of France is", "The capital is France of"  # 5 tokens each (tiny tokenizer)
MODULES = ["model.layers.*", "model.layers.1.self_attn.q_proj"]


def paris(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, -1, 5] - logits[0, -1, 17]


UNEVEN = dict(hidden_size=72, num_heads=9, num_kv_heads=3)  # the demo model's heads: 6 and 3 per rank under tp
CASES = [("llama", d) for d in ("gather", "reshard", "tp")] + [("qwen3_moe", "tp")]  # tp with the experts split


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {
        "llama": make_tiny_lm(tmp_path_factory.mktemp("llama") / "llama", family="llama", **UNEVEN),
        "qwen3_moe": make_tiny_moe(tmp_path_factory.mktemp("moe") / "moe", "qwen3_moe", head_dim=8, **UNEVEN),
    }


def sweep(rank: int, path: Path, decode: str) -> dict:
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.inspection.patching import patch_sweep
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode=decode)
    )
    loaded = load_sharded(config, device="cpu")
    args = {"clean": CLEAN, "corrupt": CORRUPT, "modules": MODULES, "metric": "paris"}
    out = {
        m: patch_sweep(loaded.model, loaded.tokenizer, {**args, "method": m}, {"paris": paris})
        for m in ("activation", "attribution")
    }
    return out if rank == 0 else {}


def one_process(path: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    clean, corrupt = (tok(p, return_tensors="pt")["input_ids"] for p in (CLEAN, CORRUPT))
    names = ["model.layers.0", "model.layers.1", "model.layers.1.self_attn.q_proj"]
    seen = {}

    def keep(name):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            seen[name] = out

        return hook

    hooks = [model.get_submodule(n).register_forward_hook(keep(n)) for n in names]
    with torch.no_grad():
        model(clean)
    clean_out = {n: t.clone() for n, t in seen.items()}
    corrupt_metric = paris(model(corrupt).logits)
    grads = dict(zip(names, torch.autograd.grad(corrupt_metric, [seen[n] for n in names])))
    corrupt_out = {n: t.detach() for n, t in seen.items()}
    for hook in hooks:
        hook.remove()
    effect = torch.zeros(len(names), clean.shape[1])
    attribution = torch.zeros_like(effect)
    for i, name in enumerate(names):
        attribution[i] = ((clean_out[name] - corrupt_out[name]) * grads[name]).sum(-1)[0] + corrupt_metric.detach()
        for pos in range(clean.shape[1]):

            def patch(module, args, out, pos=pos, name=name):
                t = (out[0] if isinstance(out, tuple) else out).clone()
                t[0, pos] = clean_out[name][0, pos]
                return (t, *out[1:]) if isinstance(out, tuple) else t

            handle = model.get_submodule(name).register_forward_hook(patch)
            with torch.no_grad():
                effect[i, pos] = paris(model(corrupt).logits)
            handle.remove()
    return {"names": names, "activation": effect, "attribution": attribution, "corrupt": float(corrupt_metric.detach())}


@pytest.mark.parametrize("family, decode", CASES)
def test_patching_sweep_matches_one_process(ranks, tiny, family, decode):
    want = one_process(tiny[family])
    got = ranks(sweep, tiny[family], decode, deadline=240)[0]
    for method in ("activation", "attribution"):
        result = got[method]
        assert result["modules"] == want["names"]
        assert abs(result["corrupt_metric"] - want["corrupt"]) <= 1e-4 * (1 + abs(want["corrupt"]))
        diff = (result["effect"] - want[method]).abs()
        assert (diff <= 1e-4 * (1 + want[method].abs())).all(), (method, diff.max())
