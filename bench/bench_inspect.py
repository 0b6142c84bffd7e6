"""Inspection benchmark (issue 12): `trace` of every layer against a plain forward, per layout; nnsight against hooks.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_inspect.py            # demo model, 2 gloo ranks, 10 runs each
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_inspect.py --dataset 256   # issue 19, see print_dataset

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


class PeakMemory:
    """This process's peak resident memory while the block runs (sampled every 5 ms), in bytes above its start."""

    def __enter__(self):
        import threading

        import psutil

        self._process, self._done = psutil.Process(), threading.Event()
        self.start = self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def added(self) -> int:
        return self.peak - self.start


def dataset_run(rank: int, path: str, decode: str, count: int, batch_size: int) -> dict:
    """Issue 19 on one layout: (1) every decoder layer's output averaged over `count` prompts, by a loop of one-prompt
    traces averaged on rank 0 and by one batched trace reduced on the ranks; (2) the patching sweep of every layer and
    position, by `patch_sweep` and by the notebook's loop (an intervention per layer and position, one trace each);
    (3) a forward with the backward of a logit difference against a plain forward."""
    from shardbook.rankd.inspection.batched import trace_many
    from shardbook.rankd.inspection.tracing import trace

    loaded = load(path, decode)
    model, tok = loaded.model, loaded.tokenizer
    prompts = dataset_prompts(count)
    with PeakMemory() as loop_memory:
        started = time.perf_counter()
        totals, tokens = {}, 0
        for prompt in prompts:
            t = trace(model, tok, {"prompt": prompt, "modules": []})
            if rank == 0:
                for name, x in t.items():
                    totals[name] = totals.get(name, 0) + x[0].double().sum(0)
                tokens += len(t.token_ids)
        loop_s = time.perf_counter() - started
    with PeakMemory() as batched_memory:
        started = time.perf_counter()
        reduced = trace_many(
            model, tok, {"prompts": prompts, "modules": [], "reduce": "mean", "batch_size": batch_size}
        )
        batched_s = time.perf_counter() - started
    patching = patching_run(rank, model, tok)
    gradients = gradient_run(model, tok)
    if rank != 0:
        return {}
    diff = max((reduced[n].double() - totals[n] / tokens).abs().max().item() for n in reduced)
    return {
        "layers": len(reduced),
        "loop_s": loop_s,
        "batched_s": batched_s,
        "max_diff": diff,
        "bytes": reduced.stats["bytes_to_rank0"],
        "loop_peak": loop_memory.added,
        "batched_peak": batched_memory.added,
        **patching,
        **gradients,
    }


CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"


def patching_run(rank: int, model, tok) -> dict:
    """`patch_sweep` over every layer against the notebook's loop over layers (and here every position too)."""
    import torch

    from shardbook.rankd.inspection import interventions
    from shardbook.rankd.inspection.patching import patch_sweep
    from shardbook.rankd.inspection.tracing import layer_names, trace

    paris, rome = (tok(w)["input_ids"][0] for w in (" Paris", " Rome"))

    def metric(logits):
        return logits[0, -1, paris] - logits[0, -1, rome]

    names = layer_names(model)
    clean, current = {}, {}
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: clean.__setitem__(n, o)) for n in names]
    with torch.no_grad():
        model(tok(CLEAN, return_tensors="pt")["input_ids"])
    for hook in hooks:
        hook.remove()
    clean = {n: (o[0] if isinstance(o, tuple) else o).clone() for n, o in clean.items()}
    positions = len(tok(CORRUPT)["input_ids"])

    def patch(output, module_name):
        output[:, current["position"]] = clean[module_name][:, current["position"]]

    started = time.perf_counter()
    loop = torch.zeros(len(names), positions)
    for i, name in enumerate(names):
        interventions.add(model, {"patch": patch}, "patch", [name], False)
        for position in range(positions):
            current["position"] = position
            out = trace(model, tok, {"prompt": CORRUPT, "modules": [names[0]]})
            if rank == 0:
                loop[i, position] = metric(out.logits[None]).item()
        interventions.remove(model, "patch")
    loop_s = time.perf_counter() - started
    started = time.perf_counter()
    args = {"clean": CLEAN, "corrupt": CORRUPT, "modules": ["model.layers.*"], "metric": "m"}
    sweep = patch_sweep(model, tok, args, {"m": metric})
    sweep_s = time.perf_counter() - started
    if rank != 0:
        return {}
    diff = (sweep["effect"] - loop).abs().max().item()
    return {"patch_cells": loop.numel(), "patch_loop_s": loop_s, "patch_sweep_s": sweep_s, "patch_diff": diff}


def gradient_run(model, tok) -> dict:
    """Median of 5 interleaved rounds: a plain forward, and a forward with the backward of a logit difference."""
    import torch

    ids = tok(PROMPT, return_tensors="pt")["input_ids"]

    def forward():
        with torch.no_grad():
            model(ids)

    def backward():
        logits = model(ids).logits
        (logits[0, -1, 0] - logits[0, -1, 1]).backward()

    model.requires_grad_(True)
    times = interleaved_medians({"forward": forward, "backward": backward}, 5)
    model.requires_grad_(False)
    model.zero_grad(set_to_none=True)
    return {"forward_s": times["forward"], "backward_s": times["backward"]}


def print_dataset(args) -> None:
    from tests.ranks import run_ranks

    print(
        f"model {args.model}; {args.dataset} prompts, mean of every decoder layer's output over every token; "
        f"batch size {args.batch_size}; 2 gloo ranks\n"
    )
    print(
        f"{'layout':<8} {'loop p/s':>8} {'batched p/s':>11} {'speed-up':>8} {'max |diff|':>10} {'bytes':>7} "
        f"{'peak MiB loop':>13} {'batched':>7} | {'patch cells':>11} {'loop s':>7} {'%patch s':>8} {'speed-up':>8} "
        f"{'max |diff|':>10} | {'fwd ms':>7} {'fwd+bwd ms':>10} {'x fwd':>6}"
    )
    for decode in args.layouts:
        r = run_ranks(dataset_run, args.model, decode, args.dataset, args.batch_size, deadline=7200)[0]
        print(
            f"{decode:<8} {args.dataset / r['loop_s']:>8.2f} {args.dataset / r['batched_s']:>11.2f} "
            f"{r['loop_s'] / r['batched_s']:>8.1f} {r['max_diff']:>10.1e} {r['bytes']:>7,} "
            f"{r['loop_peak'] / 2**20:>13.0f} {r['batched_peak'] / 2**20:>7.0f} | {r['patch_cells']:>11} "
            f"{r['patch_loop_s']:>7.1f} {r['patch_sweep_s']:>8.1f} {r['patch_loop_s'] / r['patch_sweep_s']:>8.1f} "
            f"{r['patch_diff']:>10.1e} | {r['forward_s'] * 1e3:>7.1f} {r['backward_s'] * 1e3:>10.1f} "
            f"{r['backward_s'] / r['forward_s']:>6.2f}",
            flush=True,
        )


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
        print_dataset(args)
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
