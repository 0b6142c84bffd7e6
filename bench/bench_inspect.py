"""Inspection benchmark (issue 12): `trace` of every layer against a plain forward, per layout; nnsight against hooks.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_inspect.py            # demo model, 2 gloo ranks, 10 runs each
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_inspect.py --dataset 256   # issue 19: batched+reduced vs a loop

Part 1, for each layout on 2 ranks (spawned processes, gloo, one thread each): the median time
of a plain forward of the prompt, of `trace` of every decoder layer (what `%%trace` runs on each
rank: hooks, forward, size check, join on rank 0), of `trace` of every layer's up_proj (split by
rows under `tp`, so gathered), and the bytes rank 0 received for each.

Part 2, in one process (one thread), only if nnsight is importable: a plain forward, forward
hooks keeping every layer's output, and nnsight's `trace` saving the same outputs, to weigh what
building on nnsight would cost; then what nnsight sees of q_proj under `tp` on 2 ranks (the
rank's own rows only: it knows nothing of the split).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = "The capital of France is Paris, and the capital of Germany is"


def interleaved_medians(fns: dict, runs: int) -> dict[str, float]:
    """Median seconds of each function, run in turn each round (one warm-up round),
    so load on a shared machine hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(runs + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def load(path: str, decode: str):
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=path, dtype="float32"), parallel=ParallelConfig(decode=decode)
    )
    return load_sharded(config, device="cpu")


def layout_run(rank: int, path: str, decode: str, runs: int) -> dict:
    import torch

    from shardbook.rankd.inspection.tracing import trace

    loaded = load(path, decode)
    model, tok = loaded.model, loaded.tokenizer
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    last: dict = {}

    def traced(label: str, modules: list[str]):
        return lambda: last.__setitem__(label, trace(model, tok, {"prompt": PROMPT, "modules": modules}))

    with torch.no_grad():
        medians = interleaved_medians(
            {
                "forward": lambda: model(ids),
                "layers": traced("layers", []),
                "up_proj": traced("up_proj", ["model.layers.*.mlp.up_proj"]),
            },
            runs,
        )
    result = {"tokens": ids.shape[1], **{f"{k}_s": v for k, v in medians.items()}}
    for label in ("layers", "up_proj"):
        out = last[label]
        result[f"{label}_bytes"] = out.stats["bytes_to_rank0"] if rank == 0 else 0
        result[f"{label}_captured"] = sum(t.numel() * t.element_size() for t in out.values()) if rank == 0 else 0
    return result


def one_process(path: str, runs: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")["input_ids"]

    def hooked():
        kept = []
        hooks = [layer.register_forward_hook(lambda m, a, o: kept.append(o)) for layer in model.model.layers]
        model(ids)
        for hook in hooks:
            hook.remove()

    fns = {"forward": lambda: model(ids), "hooks": hooked}
    try:
        from nnsight import NNsight
    except ImportError:
        NNsight = None
    if NNsight is not None:
        wrapped = NNsight(model)

        def traced():
            saved = []
            with wrapped.trace(ids):
                for layer in wrapped.model.layers:
                    saved.append(layer.output.save())
            assert len(saved) == len(model.model.layers)

        fns["nnsight"] = traced
    with torch.no_grad():
        return {f"{k}_s": v for k, v in interleaved_medians(fns, runs).items()}


def nnsight_under_tp(rank: int, path: str) -> dict:
    """The shape nnsight saves for layer 0's q_proj under tp, and the shape `trace` gives rank 0."""
    import torch
    from nnsight import NNsight

    from shardbook.rankd.inspection.tracing import trace

    loaded = load(path, "tp")
    ids = loaded.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    saved = []
    wrapped = NNsight(loaded.model)
    with torch.no_grad(), wrapped.trace(ids):
        saved.append(wrapped.model.layers[0].self_attn.q_proj.output.save())
    ours = trace(loaded.model, loaded.tokenizer, {"prompt": PROMPT, "modules": ["model.layers.0.self_attn.q_proj"]})
    return {
        "nnsight": tuple(saved[0].shape),
        "trace": tuple(ours["model.layers.0.self_attn.q_proj"].shape) if rank == 0 else None,
    }


def dataset_prompts(count: int) -> list[str]:
    subjects = ["France", "Japan", "the river", "my friend", "this book", "the old city", "a small cat", "the team"]
    verbs = ["is", "was known as", "looked like", "seemed to be", "became"]
    return [
        f"Sentence {i}: {subjects[i % len(subjects)]} {verbs[i % len(verbs)]} " + "very " * (i % 7) + "interesting"
        for i in range(count)
    ]


def batch_run(rank: int, path: str, decode: str, count: int, batch_size: int) -> dict:
    """Issue 19: the mean of layer 12's output over `count` prompts, batched and reduced on the ranks against
    a loop of one-prompt traces averaged on rank 0; then a forward with backward against a plain forward."""
    import torch

    from shardbook.rankd.inspection.batched import trace_many
    from shardbook.rankd.inspection.tracing import trace

    loaded = load(path, decode)
    model, tok = loaded.model, loaded.tokenizer
    prompts, module = dataset_prompts(count), "model.layers.12"
    started = time.perf_counter()
    total, tokens = None, 0
    for prompt in prompts:
        t = trace(model, tok, {"prompt": prompt, "modules": [module]})
        if rank == 0:
            x = t[module][0].double()
            total, tokens = (x.sum(0) if total is None else total + x.sum(0)), tokens + x.shape[0]
    loop_s = time.perf_counter() - started
    started = time.perf_counter()
    reduced = trace_many(
        model, tok, {"prompts": prompts, "modules": [module], "reduce": "mean", "batch_size": batch_size}
    )
    batched_s = time.perf_counter() - started
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]

    def forward():
        with torch.no_grad():
            model(ids)

    def backward():
        logits = model(ids, inputs_embeds=None).logits
        (logits[0, -1, 0] - logits[0, -1, 1]).backward()

    model.requires_grad_(True)
    times = interleaved_medians({"forward": forward, "backward": backward}, 5)
    model.requires_grad_(False)
    if rank != 0:
        return {}
    diff = (reduced[module].double() - total / tokens).abs().max().item()
    return {
        "loop_s": loop_s,
        "batched_s": batched_s,
        "max_diff": diff,
        "bytes": reduced.stats["bytes_to_rank0"],
        "forward_s": times["forward"],
        "backward_s": times["backward"],
    }


def main() -> None:
    from shardbook.kernel.api.fetch import demo_model_dir
    from tests.ranks import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(demo_model_dir("smollm2-135m-instruct")))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--dataset", type=int, metavar="N", help="issue 19 only: N prompts batched+reduced vs a loop")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layouts", nargs="+", default=["gather", "reshard", "tp"])
    args = parser.parse_args()
    if args.dataset:
        print(f"model {args.model}; {args.dataset} prompts, mean of model.layers.12 over every token; 2 gloo ranks\n")
        print(
            f"{'layout':<8} {'loop of traces s':>16} {'batched+reduced s':>17} {'speed-up':>8} {'max |diff|':>10} "
            f"{'forward ms':>10} {'fwd+bwd ms':>10} {'x forward':>9}"
        )
        for decode in args.layouts:
            r = run_ranks(batch_run, args.model, decode, args.dataset, args.batch_size, deadline=3000)[0]
            print(
                f"{decode:<8} {r['loop_s']:>16.1f} {r['batched_s']:>17.1f} {r['loop_s'] / r['batched_s']:>8.1f} "
                f"{r['max_diff']:>10.1e} {r['forward_s'] * 1e3:>10.1f} {r['backward_s'] * 1e3:>10.1f} "
                f"{r['backward_s'] / r['forward_s']:>9.2f}"
            )
        return
    print(f"model {args.model}; prompt {PROMPT!r}; median of {args.runs} interleaved rounds after a warm-up round\n")
    print(
        f"{'layout':<8} {'forward ms':>10} {'trace layers ms':>16} {'x forward':>9} {'bytes to rank 0':>15} "
        f"{'trace up_proj ms':>17} {'x forward':>9} {'bytes to rank 0':>15}"
    )
    for decode in ("gather", "reshard", "tp"):
        r = run_ranks(layout_run, args.model, decode, args.runs, deadline=900)[0]
        print(
            f"{decode:<8} {r['forward_s'] * 1e3:>10.1f} {r['layers_s'] * 1e3:>16.1f} "
            f"{r['layers_s'] / r['forward_s']:>9.2f} "
            f"{r['layers_bytes']:>15,} {r['up_proj_s'] * 1e3:>17.1f} {r['up_proj_s'] / r['forward_s']:>9.2f} "
            f"{r['up_proj_bytes']:>15,}"
        )
    print(
        f"(captured on rank 0: all layers {r['layers_captured']:,} bytes, "
        f"every up_proj {r['up_proj_captured']:,} bytes; "
        f"{r['tokens']} tokens)\n"
    )
    single = one_process(args.model, args.runs)
    print(
        f"one process: forward {single['forward_s'] * 1e3:.1f} ms, "
        f"hooks on every layer {single['hooks_s'] * 1e3:.1f} ms "
        f"(x{single['hooks_s'] / single['forward_s']:.2f})",
        end="",
    )
    if "nnsight_s" not in single:
        print("; nnsight not installed, skipped")
        return
    print(
        f", nnsight trace saving every layer {single['nnsight_s'] * 1e3:.1f} ms "
        f"(x{single['nnsight_s'] / single['forward_s']:.2f}; "
        f"x{single['nnsight_s'] / single['hooks_s']:.2f} of hooks)"
    )
    shapes = run_ranks(nnsight_under_tp, args.model, deadline=600)
    print(
        f"under tp, layer 0 q_proj output: nnsight saves {shapes[0]['nnsight']} on rank 0 "
        f"and {shapes[1]['nnsight']} on rank 1; "
        f"trace gives rank 0 {shapes[0]['trace']}"
    )


if __name__ == "__main__":
    main()
