"""Batched traces, reductions on the ranks and captures streamed to files, on 2 gloo ranks.

A batched trace must equal one-prompt traces prompt by prompt (padding never leaks), a reduced one
the reduction of one-prompt captures, with only the reduced tensor reaching rank 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny import make_tiny_lm, make_tiny_moe

WORDS = "the capital of France is Paris and the quick brown fox jumps over a lazy dog while cats sleep".split()
PROMPTS = [" ".join(WORDS[i % 7 : i % 7 + 1 + (i * 5) % 11]) for i in range(64)]
MODULES = ["model.layers.*", "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.act_fn"]
MOE_MODULES = ["model.layers.*", "model.layers.1.self_attn.q_proj", "model.layers.0.mlp"]
UNEVEN = dict(hidden_size=72, num_heads=9, num_kv_heads=3)  # the demo model's heads: 6 and 3 per rank under tp
CASES = [("llama", d) for d in ("gather", "reshard", "tp")] + [("qwen3_moe", "tp")]  # tp with the experts split


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_lm(tmp_path_factory.mktemp("llama") / "llama", family="llama", **UNEVEN)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "moe", "qwen3_moe", head_dim=8, **UNEVEN)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bad = (got - want).abs() > 1e-4 * (1 + want.abs())
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} differ, max {(got - want).abs().max():.3g}"


def run(rank: int, path: Path, decode: str, out_dir: Path, modules: list[str]) -> dict:
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.inspection.batched import trace_many
    from shardbook.rankd.inspection.tracing import trace
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode=decode)
    )
    loaded = load_sharded(config, device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    singles = [trace(model, tok, {"prompt": p, "modules": modules}) for p in PROMPTS]
    batched = trace_many(model, tok, {"prompts": PROMPTS[:16], "modules": modules, "batch_size": 5})
    reduced = {
        op: trace_many(model, tok, {"prompts": PROMPTS, "modules": modules, "batch_size": 8, "reduce": op})
        for op in ("mean", "sum", "max", "var")
    }
    per_prompt = trace_many(
        model, tok, {"prompts": PROMPTS, "modules": modules, "batch_size": 5, "reduce": "mean", "per_prompt": True}
    )  # 13 batches: under gather and reshard rank 1 has none in the last round
    projection = torch.arange(72 * 3, dtype=torch.float32).reshape(72, 3) / 100
    projected = trace_many(
        model,
        tok,
        {"prompts": PROMPTS, "modules": ["model.layers.1.self_attn.q_proj"], "reduce": "mean", "project": "P"},
        {"P": projection},
    )
    files = trace_many(model, tok, {"prompts": PROMPTS[:16], "modules": modules, "batch_size": 6, "to": str(out_dir)})
    if rank != 0:
        return {}
    return {
        "singles": [dict(t) | {"logits": t.logits} for t in singles],
        "batched": [dict(t) | {"logits": t.logits} for t in batched],
        "reduced": {op: (dict(r), r.stats) for op, r in reduced.items()},
        "per_prompt": (dict(per_prompt), per_prompt.tokens),
        "projected": (dict(projected), projection),
        "files": files.stats["files"],
    }


@pytest.mark.parametrize("family, decode", CASES)
def test_batched_reduced_and_streamed_traces_equal_one_prompt_traces(ranks, tiny, tiny_moe, tmp_path, family, decode):
    from shardbook.rankd.inspection.batched import load_captures

    moe = family == "qwen3_moe"
    modules = MOE_MODULES if moe else MODULES
    got = ranks(run, tiny_moe if moe else tiny, decode, tmp_path / "captures", modules, deadline=300)[0]
    singles = got["singles"]
    assert len({len(s["logits"]) for s in singles[:16]}) > 5  # prompts of many lengths
    assert len(got["batched"]) == 16
    for i, (one, many) in enumerate(zip(singles, got["batched"])):
        for name in one:
            close(many[name], one[name], f"prompt {i} {name}")
    for op, (values, stats) in got["reduced"].items():
        for name in modules[1:] + ["model.layers.0", "model.layers.1"]:
            tokens = torch.cat([s[name][0].flatten(1) for s in singles])  # every token of every prompt
            want = {"mean": tokens.mean(0), "sum": tokens.sum(0), "max": tokens.amax(0), "var": tokens.var(0, False)}
            close(values[name].flatten(), want[op], f"{op} {name}")
        if decode == "tp":  # only the split captures' reduced pieces move: q_proj 54 + act_fn features, from rank 1
            q, act = values[modules[1]], values[modules[2]]
            assert 0 < stats["bytes_to_rank0"] <= (q.numel() + act.numel()) * 4
            assert (stats["ranks_sharing_prompts"], stats["batches"]) == (1, 8)
        else:  # the ranks split the prompts (4 batches each); rank 1's counts and partial sums (maxima) move once
            partials = sum(v.numel() for v in values.values()) * (2 if op == "var" else 1)
            assert stats["bytes_to_rank0"] == 64 * 8 + partials * (4 if op == "max" else 8)
            assert (stats["ranks_sharing_prompts"], stats["batches"]) == (2, 4)
    means, tokens = got["per_prompt"]
    assert tokens == [len(s["logits"]) for s in singles]
    for i, s in enumerate(singles):
        close(means["model.layers.1"][i], s["model.layers.1"][0].mean(0), f"per-prompt mean {i}")
    values, projection = got["projected"]
    want = torch.cat([s[modules[1]][0] for s in singles]) @ projection
    close(values[modules[1]], want.mean(0), "projected mean")
    assert len(got["files"]) == 3
    stored = load_captures(Path(got["files"][0]).parent)
    assert sorted(stored) == list(range(16))
    for i, s in enumerate(singles[:16]):
        for name in modules[1:] + ["model.layers.0"]:
            close(stored[i][name], s[name][0], f"file prompt {i} {name}")
        assert stored[i]["token_ids"].shape[0] == s["logits"].shape[0]


def test_a_bad_prompts_line_is_named(tmp_path):
    from shardbook.rankd.inspection.batched import read_prompts_file

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"text": "c"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 3"):
        read_prompts_file(path)
    path.write_text('{"prompt": "a"}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2: not JSON"):
        read_prompts_file(path)
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n', encoding="utf-8")
    assert read_prompts_file(path) == ["a", "b"]


def test_trace_magic_takes_a_list_or_a_file_of_prompts(tmp_path):
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import get_ipython

    from shardbook.magics.inspection import InspectionMagics

    shell = get_ipython()
    magics, calls = InspectionMagics(shell), []
    magics._call = lambda *args, **kwargs: calls.append((args, kwargs)) or {}
    shell.user_ns["qs"] = ["a b", "c"]
    magics.trace("--prompts qs --reduce mean --per-prompt --batch-size 4 --as r", "")
    (method, prompts, modules), kwargs = calls[-1]
    assert (method, prompts, kwargs["reduce"], kwargs["per_prompt"], kwargs["batch_size"]) == (
        "trace_many",
        ["a b", "c"],
        "mean",
        True,
        4,
    )
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\n{"prompt": "y z"}\n', encoding="utf-8")
    magics.trace(f"--in {path} --to {tmp_path / 'out'}")
    assert calls[-1][0][1] == ["x", "y z"] and calls[-1][1]["to"] == str(tmp_path / "out")
    path.write_text('{"prompt": "x"}\n[1]\n', encoding="utf-8")
    with pytest.raises(UsageError, match="line 2"):
        magics.trace(f"--in {path}")
    with pytest.raises(UsageError, match="no non-empty list"):
        magics.trace("--prompts missing")


def interrupted_on_rank1(rank: int, path: Path, decode: str) -> dict:
    import threading

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.inspection.batched import trace_many
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode=decode)
    )
    loaded = load_sharded(config, device="cpu")
    stop = threading.Event()
    if rank == 1:  # only one rank was interrupted: every rank still stops after the same batch
        stop.set()
    args = {"prompts": PROMPTS[:20], "modules": ["model.layers.1"], "batch_size": 4}
    many = trace_many(loaded.model, loaded.tokenizer, args, None, stop)
    reduced = trace_many(loaded.model, loaded.tokenizer, {**args, "reduce": "sum"}, None, stop)
    if rank != 0:
        return {}
    return {"len": len(many), "interrupted": many.interrupted, "reduced": (reduced.prompts, reduced.interrupted)}


@pytest.mark.parametrize("decode, reduced", [("tp", 4), ("gather", 8)])  # under gather a round is a batch per rank
def test_an_interrupt_on_any_rank_keeps_the_batches_that_finished(ranks, tiny, decode, reduced):
    got = ranks(interrupted_on_rank1, tiny, decode)[0]
    assert got == {"len": 4, "interrupted": True, "reduced": (reduced, True)}


def test_patch_magic_passes_the_method():
    """`%patch --method` reaches `Inspector.patch` (the magic's own dispatch must not take `method` itself)."""
    from IPython.testing.globalipapp import get_ipython

    from shardbook.magics.inspection import InspectionMagics

    class Stop(Exception):
        pass

    class FakeInspector:
        def patch(self, *args, **kwargs):
            calls.append((args, kwargs))
            raise Stop

    shell = get_ipython()
    magics, calls = InspectionMagics(shell), []
    magics._inspector = lambda: (FakeInspector(), None)
    shell.user_ns.update(c="a b", d="a c")
    with pytest.raises(Stop):
        magics.patch("--clean c --corrupt d --modules model.layers.* --metric m --method attribution")
    assert calls == [(("a b", "a c", ["model.layers.*"], "m"), {"method": "attribution", "chat": False})]
