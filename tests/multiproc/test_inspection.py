"""Tracing, the logit lens, full parameters and interventions on 2 gloo ranks, under every forward layout.

Each rank runs what the kernel's commands run (`trace`, `full_parameter_on_rank0`, the
interventions registry); rank 0's whole tensors are compared with one process's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny import make_tiny_lm

PROMPT = "The capital of France is"
LAYOUTS = ["gather", "reshard", "tp"]
# the demo model's uneven heads (6 and 3 query heads per rank under tp),
# and Qwen3's per-head q/k norms (split under tp only)
MODELS = {
    "llama-uneven": dict(family="llama", hidden_size=72, num_heads=9, num_kv_heads=3),
    "qwen3": dict(family="qwen3", num_heads=4, num_kv_heads=2),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {name: make_tiny_lm(tmp_path_factory.mktemp(name) / name, **kw) for name, kw in MODELS.items()}


def load(path: Path, decode: str):
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode=decode)
    )
    return load_sharded(config, device="cpu")


def one_process(path: Path) -> dict:
    """Every module's output, the hidden states and the logits from the unsharded model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")["input_ids"]
    seen = {}

    def keep(name):
        def hook(module, args, out):
            seen.setdefault(name, out[0] if isinstance(out, tuple) else out)

        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n.startswith("model.layers.1")]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    return {"logits": out.logits[0], "hidden": out.hidden_states, "modules": seen, "state": model.state_dict()}


def traced(rank: int, path: Path, decode: str) -> dict:
    """Decoder layers with the lens, every module of layer 1, o_proj inputs, q_proj's weight,
    and a zeroing intervention."""
    from shardbook.rankd.inspection import interventions
    from shardbook.rankd.inspection.tracing import match_modules, trace
    from shardbook.rankd.parallel.wholes import full_parameter_on_rank0

    loaded = load(path, decode)
    model, tok = loaded.model, loaded.tokenizer
    layers = trace(model, tok, {"prompt": PROMPT, "lens_top": 3})
    inner = trace(model, tok, {"prompt": PROMPT, "modules": ["model.layers.1.**"]})
    o_in = trace(model, tok, {"prompt": PROMPT, "modules": ["model.layers.*.self_attn.o_proj"], "inputs": True})
    weights = {n: full_parameter_on_rank0(model, p) for n, p in model.named_parameters() if ".1." in n or "embed" in n}
    namespace = {"zero": lambda output, name: output * 0, "half_heads": _zero_first_columns}
    interventions.add(model, namespace, "zero", match_modules(model, ["model.layers.0"]), False)
    interventions.add(model, namespace, "half_heads", match_modules(model, ["model.layers.1.self_attn.o_proj"]), True)
    zeroed = trace(model, tok, {"prompt": PROMPT, "modules": ["model.layers.0"]})
    interventions.remove(model, None)
    back = trace(model, tok, {"prompt": PROMPT, "modules": ["model.layers.0"]})
    if rank != 0:
        return {}
    return {
        "layers": dict(layers),
        "lens": layers.lens,
        "logits": layers.logits,
        "inner": dict(inner),
        "o_in": dict(o_in),
        "weights": weights,
        "zeroed": zeroed.logits,
        "zeroed_layer": zeroed["model.layers.0"],
        "back": back.logits,
    }


def _zero_first_columns(output, name):
    output[..., :16] = 0  # crosses the tp split only as a whole tensor would
    return output


def one_process_intervened(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")["input_ids"]
    model.model.layers[0].register_forward_hook(
        lambda m, a, out: out * 0 if not isinstance(out, tuple) else (out[0] * 0, *out[1:])
    )
    model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(
        lambda m, a: (_zero_first_columns(a[0].clone(), ""),)
    )
    with torch.no_grad():
        return model(ids).logits[0]


@pytest.mark.parametrize("model_name, decode", [("llama-uneven", d) for d in LAYOUTS] + [("qwen3", "tp")])
def test_trace_lens_parameters_and_interventions_match_one_process(ranks, tiny, decode, model_name):
    path = tiny[model_name]
    want = one_process(path)
    got = ranks(traced, path, decode)[0]
    close = dict(atol=1e-4, rtol=0)
    assert list(got["layers"]) == ["model.layers.0", "model.layers.1"]
    for i, name in enumerate(
        got["layers"]
    ):  # hidden_states[-1] has the final norm applied; layer 1's own output is in modules
        expected = want["hidden"][i + 1] if i + 1 < len(want["hidden"]) - 1 else want["modules"]["model.layers.1"]
        torch.testing.assert_close(got["layers"][name], expected, **close, msg=name)
    torch.testing.assert_close(got["logits"], want["logits"], **close)
    # the lens of the last layer is the model's own prediction
    top = torch.softmax(want["logits"], -1).topk(3, dim=-1)
    assert torch.equal(got["lens"].token_ids[-1], top.indices)
    torch.testing.assert_close(got["lens"].probs[-1], top.values, **close)
    for name, tensor in want["modules"].items():  # q/k/v, gate/up, act_fn (split under tp) and the rest
        if name == "model.layers.1":
            continue
        torch.testing.assert_close(got["inner"][name], tensor, **close, msg=name)
    for name, tensor in got["weights"].items():
        torch.testing.assert_close(tensor, want["state"][name], atol=0, rtol=0, msg=name)
    assert (
        got["o_in"]["model.layers.1.self_attn.o_proj"].shape[-1]
        == want["modules"]["model.layers.1.self_attn.q_proj"].shape[-1]
    )
    assert torch.count_nonzero(got["zeroed_layer"]) == 0
    torch.testing.assert_close(got["zeroed"], one_process_intervened(path), **close)
    torch.testing.assert_close(got["back"], want["logits"], **close)


def trace_everything(rank: int, path: Path) -> dict:
    from shardbook.rankd.inspection.tracing import trace

    loaded = load(path, "gather")
    result = trace(loaded.model, loaded.tokenizer, {"prompt": PROMPT, "modules": ["**"]})
    return {"model": result["model"], "norm": result["model.norm"], "names": list(result)}


def test_trace_of_every_module_unwraps_the_model_output(ranks, tiny):
    """`**` matches `model` too, whose output is a BaseModelOutputWithPast: its last_hidden_state is captured."""
    (got,) = ranks(trace_everything, tiny["llama-uneven"], world_size=1)
    assert "model" in got["names"] and "model.layers.1.mlp.down_proj" in got["names"]
    torch.testing.assert_close(got["model"], got["norm"])


def test_every_magic_drops_the_quotes_around_a_value():
    from IPython.testing.globalipapp import get_ipython

    from shardbook.magics.arguments import split_line
    from shardbook.magics.inspection import InspectionMagics

    magics, calls = InspectionMagics(get_ipython()), []
    magics._call = lambda *args, **kwargs: calls.append(args) or {}
    magics.trace("--modules \"**\" 'model.layers.*' --as t", "The capital of France is")
    assert calls == [("trace", "The capital of France is", ["**", "model.layers.*"])]
    assert split_line("--system 'Be brief.' \"b c\" d") == ["--system", "Be brief.", "b c", "d"]
