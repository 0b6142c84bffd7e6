"""Loading benchmark (issue 3): sharded loading against single-process `from_pretrained`
and against full-load-then-shard.

Each method runs in fresh processes (one CPU thread each), after the checkpoint is in the page
cache and the modules every method needs are imported (a cold import of transformers' model
code adds about 1 s to every method). Per rank it measures the load time, the time to the first
token of a first reply (a greedy `generate` of one token after an 8-token prompt; the issue's
"load + first token", set against `from_pretrained` + first token), the same first token of a
second reply (the first reply's should be within 1.5x of it), and the memory above the rank's
own baseline taken after imports and process-group set-up: peak private memory (RssAnon, sampled
every 2 ms by the parent process in a first, untimed round: the sampler is a busy third process
on a 2-core machine) and peak total resident memory (VmHWM, reset through /proc/self/clear_refs; it also counts the
mapped pages of the safetensors files). Times are the best of the timed rounds that follow.

    python bench/bench_load.py                      # the demo model, 2 ranks
    python bench/bench_load.py --model DIR --ranks 2 --repeat 3
    python bench/bench_load.py --repeat 1           # a smoke run
    python bench/bench_load.py --fp8 --repeat 2     # issue 30: an FP8-block checkpoint (see load_fp8.py)

With `--fp8` it writes, in a temporary directory, a random 100M Llama as an FP8-block checkpoint (as GLM-5-FP8
ships it) and its bf16 twin, and measures, in bfloat16: the sharded load of the FP8 files, transformers'
`from_pretrained` of the same files in one process (which dequantizes them to bf16 on a machine without a GPU),
and the sharded load of the bf16 twin.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import queue
import sys
import tempfile
import time
from pathlib import Path

import platformdirs
from load_fp8 import report_fp8, write_fp8_pair

REPO_ROOT = Path(__file__).resolve().parents[1]
METHODS = ("sharded", "from_pretrained", "full_then_shard")
FP8_METHODS = ("sharded-fp8", "from_pretrained-fp8", "sharded-bf16")
"""`--fp8`'s runs: the loader (a `METHODS` entry before the dash) and the checkpoint (after it)."""
MIB = 2**20


def demo_model_dir() -> Path:
    home = Path(os.environ.get("SHARDBOOK_HOME") or platformdirs.user_cache_dir("shardbook"))
    return home / "models" / "smollm2-135m-instruct"


def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS and RssAnon of this process, in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def anon_bytes(pid: int) -> int | None:
    """RssAnon of process `pid` in bytes, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def load_once(method: str, model_dir: Path, dtype: str, decode: str) -> tuple[object, dict[str, float], dict]:
    """One load by `method` in `dtype` (`decode`: the sharded load's layout): the model (kept alive until
    measured), the seconds each part took, and for a sharded load what its summary says (layout, checkpoint
    bytes, bytes held, quantized tensors)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    parts: dict[str, float] = {}

    def part_done(name: str) -> None:
        parts[name] = time.monotonic() - started - sum(parts.values())

    if method == "sharded":
        import types

        from shardbook.rankd.loading.load_sharded import load_sharded

        config = types.SimpleNamespace(
            model=types.SimpleNamespace(model_name_or_path=str(model_dir), dtype=dtype, trust_remote_code=False),
            parallel=types.SimpleNamespace(fsdp_size=-1, ep_size=1, ep_fsdp_size=1, decode=decode),
        )
        on_step = lambda step, done, total: done == total and part_done(step)  # noqa: E731
        loaded = load_sharded(config, device="cpu", progress=on_step)
        part_done("summary")
        keys = ("decode", "checkpoint_bytes", "local_param_bytes", "quantized_tensors")
        return loaded.model, parts, {key: loaded.summary[key] for key in keys if key in loaded.summary}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    part_done("model")
    AutoTokenizer.from_pretrained(model_dir)
    part_done("tokenizer")
    if method == "full_then_shard":
        import torch.distributed as dist

        from shardbook.rankd.parallel.layout import apply_fsdp, init_mesh

        mesh = init_mesh("cpu", (dist.get_world_size(),), ("shard",))
        apply_fsdp(model, mesh, reshard_after_forward=False, on_group=lambda done, total: None)
        part_done("shard")
    return model, parts, {}


def warm_imports(model_dir: Path) -> None:
    """Import what every method needs (transformers' lazy modules, the model's code, FSDP, DCP,
    transformers' FP8 loader), as after a first load."""
    import torch
    import torch.distributed.checkpoint
    import transformers.integrations.finegrained_fp8
    import transformers.quantizers.auto  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    import shardbook.rankd.loading.load_sharded  # noqa: F401

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def rank_main(rank: int, world: int, store: str, method: str, model_dir: str, dtype: str, decode: str, results) -> None:
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    warm_imports(Path(model_dir))
    dist.barrier()
    gc.collect()
    baseline = proc_status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart VmHWM from the current RSS
    started = time.monotonic()
    model, parts, facts = load_once(method, Path(model_dir), dtype, decode)
    loaded = time.monotonic()
    after = proc_status()
    first_token(model, synced=world > 1)  # pages in lazily mapped weights, gathers sharded ones (if the load has not)
    ready = time.monotonic()
    first_token(model, synced=world > 1)  # a second reply: what the first would cost with nothing left to do
    second_s = time.monotonic() - ready
    results.put(
        {
            "rank": rank,
            "started": started,
            "loaded": loaded,
            "seconds": loaded - started,
            "parts": parts,
            "facts": facts,
            "ready_seconds": ready - started,
            "first_token_s": ready - loaded,
            "second_token_s": second_s,
            "baseline_anon": baseline["RssAnon"],
            "end_anon": after["RssAnon"],
            "peak_rss": after["VmHWM"] - baseline["VmRSS"],
        }
    )
    del model
    dist.destroy_process_group()


def first_token(model, *, synced: bool) -> None:
    """A reply's first token: greedy `generate` of one token after an 8-token prompt (every rank together)."""
    import torch

    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False, synced_gpus=synced
        )


def run_method(
    method: str, world: int, model_dir: Path, sample: bool, dtype: str = "float32", decode: str = "auto"
) -> list[dict]:
    """Run `method` in `dtype` (sharded: in the `decode` layout) on `world` fresh ranks; with `sample`, this
    process samples their RssAnon every 2 ms.

    Sampling is a third busy process on a 2-core machine, so timed rounds run without it.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=rank_main, args=(rank, world, f"{tmp}/store", method, str(model_dir), dtype, decode, results)
            )
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        samples: dict[int, list[tuple[float, int]]] = {rank: [] for rank in range(world)}
        rows: list[dict] = []
        deadline = time.monotonic() + 600
        while len(rows) < world and time.monotonic() < deadline:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                break  # a rank failed (its traceback is on stderr): the others may be waiting for it
            if not sample:
                try:
                    rows.append(results.get(timeout=1.0))
                except queue.Empty:
                    pass
                continue
            for rank, proc in enumerate(procs):
                anon = anon_bytes(proc.pid)
                if anon is not None:
                    samples[rank].append((time.monotonic(), anon))
            try:
                rows.append(results.get_nowait())
            except queue.Empty:
                time.sleep(0.002)
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
    if len(rows) < world:
        sys.exit(f"{method}: {world - len(rows)} rank(s) did not report (died, or ran past 600 s)")
    for row in rows:
        during = [anon for t, anon in samples[row["rank"]] if row["started"] <= t <= row["loaded"]]
        row["peak_anon"] = max([row["end_anon"], *during]) - row["baseline_anon"]
    return sorted(rows, key=lambda row: row["rank"])


def model_sizes(model_dir: Path) -> tuple[int, int]:
    """Bytes of the whole model and of its largest tensor once loaded in float32 (from the safetensors headers)."""
    from safetensors import safe_open

    numels = []
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            numels.extend(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return 4 * sum(numels), 4 * max(numels)


def report(figures: dict[str, list[dict]], world: int, model_dir: Path) -> None:
    total, largest = model_sizes(model_dir)
    budget = 1.3 * total / world + largest
    print(
        f"model {model_dir.name} in float32: {total / MIB:.0f} MiB, largest tensor {largest / MIB:.0f} MiB; "
        f"{world} ranks, 1 thread each"
    )
    print("times: best timed round; memory: above each rank's baseline after imports (private: the sampled round)")
    header = ("method", "ranks", "load s", "+1st token s", "1st / 2nd reply's 1st token ms")
    header += ("peak anon MiB/rank", "peak RSS MiB/rank")
    print("{:<16} {:>5} {:>7} {:>13} {:>31} {:>19} {:>18}".format(*header))
    for method, rows in figures.items():
        anon = max(row["peak_anon"] for row in rows)
        rss = max(row["peak_rss"] for row in rows)
        seconds = max(row["seconds"] for row in rows)
        ready = max(row["ready_seconds"] for row in rows)
        first = 1000 * max(row["first_token_s"] for row in rows)
        second = 1000 * max(row["second_token_s"] for row in rows)
        tokens = f"{first:.0f} / {second:.0f}"
        print(
            f"{method:<16} {len(rows):>5} {seconds:>7.2f} {ready:>13.2f} {tokens:>31} {anon / MIB:>19.0f} "
            f"{rss / MIB:>18.0f}"
        )
    print("where the time went (slowest rank of the best round, ms):")
    for method, rows in figures.items():
        slowest = max(rows, key=lambda row: row["seconds"])
        print(f"  {method:<16} " + ", ".join(f"{name} {1000 * s:.0f}" for name, s in slowest["parts"].items()))
    sharded, single, full = (figures[m] for m in METHODS)
    time_of = lambda rows: max(row["seconds"] for row in rows)  # noqa: E731
    anon_of = lambda rows: max(row["peak_anon"] for row in rows)  # noqa: E731
    print(f"load time   sharded / from_pretrained = {time_of(sharded) / time_of(single):.2f}  (target <= 1)")
    print(f"load time   sharded / full_then_shard = {time_of(sharded) / time_of(full):.2f}")
    print_first_token_ratios(sharded, single)
    print(f"peak memory sharded / from_pretrained = {anon_of(sharded) / anon_of(single):.2f}")
    print(f"peak memory sharded / full_then_shard = {anon_of(sharded) / anon_of(full):.2f}")
    print(
        f"per-rank peak anon {anon_of(sharded) / MIB:.0f} MiB vs budget 1.3 x model/ranks + largest tensor "
        f"= {budget / MIB:.0f} MiB: {'met' if anon_of(sharded) <= budget else 'MISSED'}"
    )


def print_first_token_ratios(sharded: list[dict], single: list[dict]) -> None:
    """The issue's two first-token figures side by side: load + first token against `from_pretrained`'s, and the
    first reply's first token against the second reply's, per method."""
    ready_of = lambda rows: max(row["ready_seconds"] for row in rows)  # noqa: E731
    warm_of = lambda rows: max(r["first_token_s"] for r in rows) / max(r["second_token_s"] for r in rows)  # noqa: E731
    print(
        f"load + 1st token  sharded {ready_of(sharded):.2f} s / from_pretrained {ready_of(single):.2f} s "
        f"= {ready_of(sharded) / ready_of(single):.2f}  |  1st reply's 1st token / 2nd's: "
        f"sharded {warm_of(sharded):.2f}, from_pretrained {warm_of(single):.2f}  (target <= 1.5)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=demo_model_dir(), help="checkpoint directory")
    parser.add_argument("--ranks", type=int, default=2, help="ranks for the sharded methods")
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed rounds over the methods; times are the best round's"
    )
    parser.add_argument(
        "--decode",
        default="auto",
        choices=("auto", "gather", "reshard", "tp"),
        help="the sharded loads' layout (auto picks gather when it fits, which gathers "
        "every layer in a warm-up step; reshard keeps the weights sharded)",
    )
    parser.add_argument(
        "--fp8", action="store_true", help="an FP8-block checkpoint against from_pretrained and its bf16 twin"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT))
    if args.fp8:
        with tempfile.TemporaryDirectory(prefix="bench-load-fp8-") as tmp:
            fp8, bf16 = write_fp8_pair(Path(tmp))
            checkpoints = {"fp8": fp8, "bf16": bf16}
            runs = {name: (name.split("-")[0], checkpoints[name.split("-")[1]]) for name in FP8_METHODS}
            report_fp8(measure(runs, args.ranks, args.repeat, "bfloat16", args.decode), fp8, bf16, args.ranks)
        return
    if not (args.model / "config.json").is_file():
        sys.exit(f"no checkpoint at {args.model}: run `shardbook fetch smollm2-135m-instruct` or pass --model")
    runs = {method: (method, args.model) for method in METHODS}
    report(measure(runs, args.ranks, args.repeat, "float32", args.decode), args.ranks, args.model)


def measure(
    runs: dict[str, tuple[str, Path]], ranks: int, repeat: int, dtype: str, decode: str
) -> dict[str, list[dict]]:
    """Each run's best round: `runs` maps a name to (a `METHODS` entry, its checkpoint); `from_pretrained` runs in one
    process, the others on `ranks`. A first round samples memory, `repeat` timed rounds follow."""
    for model_dir in {model_dir for _, model_dir in runs.values()}:  # every method then reads from the page cache
        for file in model_dir.glob("*.safetensors"):
            file.read_bytes()
    timed: dict[str, list[list[dict]]] = {name: [] for name in runs}
    sampled: dict[str, list[dict]] = {}
    for round_index in range(repeat + 1):  # methods interleaved, so load from other processes hits each alike
        for name, (method, model_dir) in runs.items():
            world = 1 if method == "from_pretrained" else ranks
            if round_index == 0:  # the memory round, with the sampler
                sampled[name] = run_method(method, world, model_dir, sample=True, dtype=dtype, decode=decode)
            else:
                timed[name].append(run_method(method, world, model_dir, sample=False, dtype=dtype, decode=decode))
    return {name: best_round(timed[name], sampled[name]) for name in runs}


def best_round(runs: list[list[dict]], memory: list[dict]) -> list[dict]:
    """The timed round whose slowest rank was fastest, with the sampled round's peak private memory
    and the largest total resident memory seen in any round."""
    best = min(runs, key=lambda rows: max(row["seconds"] for row in rows))
    for rank, row in enumerate(best):
        row["peak_anon"] = memory[rank]["peak_anon"]
        row["peak_rss"] = max(rows[rank]["peak_rss"] for rows in [*runs, memory])
    return best


if __name__ == "__main__":
    main()
