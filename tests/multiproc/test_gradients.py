"""Gradients under every forward layout on 2 gloo ranks: `loss.backward()` gives what one process gives.

The metric is a logit difference at the last position. Parameter gradients are joined whole with
`full_gradient_on_rank0` (each rank holds its slice's gradient); the input embedding's gradient is
the gradient of the embedding layer's output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny import make_tiny_lm, make_tiny_moe

PROMPT = "The capital of France is"
TOKENS = (5, 17)  # the metric: logit of token 5 minus logit of token 17 at the last position

MODELS = {
    "llama-uneven": lambda path: make_tiny_lm(path, family="llama", hidden_size=72, num_heads=9, num_kv_heads=3),
    "qwen3_moe": lambda path: make_tiny_moe(path, "qwen3_moe"),
    "qwen2_moe": lambda path: make_tiny_moe(path, "qwen2_moe"),  # a shared expert: one sum with the routed ones
}
CASES = [("llama-uneven", d) for d in ("gather", "reshard", "tp")] + [("qwen3_moe", "tp"), ("qwen3_moe", "gather")]
CASES += [("qwen2_moe", "tp")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {name: make(tmp_path_factory.mktemp(name) / name) for name, make in MODELS.items()}


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, -1, TOKENS[0]] - logits[0, -1, TOKENS[1]]


def backward_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Run the metric's backward; the gradient of the input embedding's output."""
    seen = {}

    def keep(module, args, out):
        out.retain_grad()
        seen["embeds"] = out

    hook = model.get_input_embeddings().register_forward_hook(keep)
    try:
        metric(model(ids).logits).backward()
    finally:
        hook.remove()
    return seen["embeds"].grad[0]


def sharded(rank: int, path: Path, decode: str) -> dict:
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded
    from shardbook.rankd.parallel.wholes import full_gradient_on_rank0

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode=decode)
    )
    loaded = load_sharded(config, device="cpu")
    model = loaded.model
    model.requires_grad_(True)
    ids = loaded.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    embeds = backward_of(model, ids)
    grads = {name: full_gradient_on_rank0(model, p) for name, p in model.named_parameters()}
    return {"embeds": embeds, "grads": grads, "decode": loaded.summary.get("decode")} if rank == 0 else {}


def one_process(path: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")["input_ids"]
    embeds = backward_of(model, ids)
    return {"embeds": embeds, "grads": {n: p.grad for n, p in model.named_parameters()}}


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got is not None and got.shape == want.shape, what
    bad = (got - want).abs() > 1e-4 * (1 + want.abs())
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} differ, max {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("model_name, decode", CASES)
def test_gradients_match_one_process(ranks, tiny, model_name, decode):
    path = tiny[model_name]
    want = one_process(path)
    got = ranks(sharded, path, decode, deadline=180)[0]
    assert got["decode"] in (None, decode)
    assert_close(got["embeds"], want["embeds"], "input embedding gradient")
    assert set(got["grads"]) == {n for n, g in want["grads"].items() if g is not None} | set(got["grads"])
    for name, grad in want["grads"].items():
        if grad is None:  # tied output weights appear once
            continue
        assert_close(got["grads"][name], grad, name)


def difference(logits: torch.Tensor) -> torch.Tensor:
    return metric(logits)


def traced_grads(rank: int, path: Path, decode: str) -> dict:
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.inspection.tracing import trace
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode=decode)
    )
    loaded = load_sharded(config, device="cpu")
    modules = ["model.embed_tokens", "model.layers.*", "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
    args = {"prompt": PROMPT, "modules": modules, "grad": "difference"}
    result = trace(loaded.model, loaded.tokenizer, args, {"difference": difference})
    frozen = all(p.grad is None for p in loaded.model.parameters())
    return {"grads": dict(result.grads), "metric": result.metric, "frozen": frozen} if rank == 0 else {}


@pytest.mark.parametrize("decode", ["reshard", "tp"])
def test_trace_grad_records_each_capture_gradient(ranks, tiny, decode):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny["llama-uneven"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")["input_ids"]
    names = ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    names += ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
    seen = {}

    def keep(name):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if not out.requires_grad:
                out = out.detach().requires_grad_(True)
                seen[name] = out
                return out
            seen[name] = out
            return None

        return hook

    hooks = [model.get_submodule(n).register_forward_hook(keep(n)) for n in names]
    value = metric(model(ids).logits)
    want = dict(zip(names, torch.autograd.grad(value, [seen[n] for n in names])))
    for hook in hooks:
        hook.remove()
    got = ranks(traced_grads, path, decode, deadline=180)[0]
    assert got["frozen"]
    value = float(value.detach())
    assert abs(got["metric"] - value) <= 1e-4 * (1 + abs(value))
    assert set(got["grads"]) == set(names)
    for name in names:
        assert_close(got["grads"][name], want[name], name)


def shared_heads_backward(rank: int, path: Path) -> str:
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode="tp")
    )
    loaded = load_sharded(config, device="cpu")
    loaded.model.requires_grad_(True)
    ids = loaded.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    try:
        metric(loaded.model(ids).logits).backward()
    except NotImplementedError as e:
        return str(e)
    return "no error"


def test_tp_with_kv_heads_shared_by_ranks_refuses_gradients_on_every_rank(ranks, tmp_path):
    path = make_tiny_lm(tmp_path / "shared", family="llama", num_heads=5, num_kv_heads=1, hidden_size=80)
    for message in ranks(shared_heads_backward, path):
        assert "key/value heads are shared by several ranks" in message, message
