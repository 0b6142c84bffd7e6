"""bfloat16 against float32 on this CPU (issue 32, item 6): the demo model's prefill and decode steps, one process
and `tp` on 2 ranks, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_dtype.py                  # demo model, batches 1,8,32,64
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_dtype.py --rounds 3 --batches 1,8

Each run loads the model in both dtypes in the same process(es) and measures them interleaved (float32,
bfloat16, float32, bfloat16, ... for `--rounds` rounds), so whatever else runs on the machine falls on both
alike; the table gives each dtype's median and the ratio. Prefill forwards one prompt of `--prefill` tokens; a
decode step forwards one token for each of `batch` rows over copies of that prompt's `DynamicCache` (the
batch's cache). `tp` loads with `load_sharded` (decode tp, 2 ranks, gloo, shared-memory sums, one
thread per rank), as `shardbook serve` does. It prints the CPU's matrix features first (AMX, AVX512-BF16), which
decide whether bfloat16 has native kernels here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")
DECODE_STEPS = 4
"""Decode steps timed per round and dtype (each after one untimed step)."""


def cpu_features() -> str:
    """The CPU's model and which bfloat16 matrix features it has, as /proc/cpuinfo and torch see them."""
    import torch

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    have = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in wanted)
    return f"{model}; {have}; torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def step_times(model, cache, batch: int) -> list[float]:
    """ms of `DECODE_STEPS` decode steps of `batch` rows, each over a copy of `cache` (one row's prompt), on every
    rank together."""
    import torch

    from shardbook.rankd.generation.cache_keyword import cache_keyword

    rows = copy.deepcopy(cache)
    rows.batch_repeat_interleave(batch)
    kwargs = {cache_keyword(model): rows, "use_cache": True}
    token = torch.full((batch, 1), 500)
    model(input_ids=token, **kwargs)  # untimed: the first step after a prefill
    return [timed(lambda: model(input_ids=token, **kwargs)) for _ in range(DECODE_STEPS)]


def prefill(model, tokens: int) -> tuple[float, object]:
    """(ms of one prompt of `tokens` tokens, the cache it leaves)."""
    import torch
    from transformers import DynamicCache

    from shardbook.rankd.generation.cache_keyword import cache_keyword

    ids = torch.randint(100, 1000, (1, tokens), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    ms = timed(lambda: model(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True))
    return ms, cache


def measure(models: dict, batches: list[int], tokens: int, rounds: int) -> dict:
    """{dtype: {what: [ms per round]}} for every dtype in `models`, interleaved round by round: a prefill of
    `tokens`, then decode steps of each batch over that prompt's cache."""
    import torch

    figures: dict = {dtype: {} for dtype in models}
    with torch.no_grad():
        for model in models.values():  # warm-up: the first forward of each shape allocates
            step_times(model, prefill(model, 8)[1], 1)
        for _ in range(rounds):
            for dtype, model in models.items():
                ms, cache = prefill(model, tokens)
                figures[dtype].setdefault(f"prefill {tokens} tokens", []).append(ms)
                for batch in batches:
                    ms = statistics.median(step_times(model, cache, batch))
                    figures[dtype].setdefault(f"decode step, batch {batch}", []).append(ms)
    return figures


def run_single(path: str, args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    models = {d: AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, d)).eval() for d in DTYPES}
    return measure(models, args.batch_list, args.prefill, args.rounds)


def run_tp(path: str, args: argparse.Namespace) -> dict | None:
    """On every rank of a torchrun job: both dtypes loaded sharded (`tp`), measured together; rank 0 returns."""
    import torch
    import torch.distributed as dist

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    models = {}
    for dtype in DTYPES:
        config = ShardbookConfig(
            model=ModelConfig(model_name_or_path=path, dtype=dtype), parallel=ParallelConfig(decode="tp")
        )
        models[dtype] = load_sharded(config, device="cpu").model
    figures = measure(models, args.batch_list, args.prefill, args.rounds)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return figures if rank == 0 else None


def launch(what: str, path: Path, argv: list[str], nproc: int) -> dict:
    """`what` (single or tp) in fresh processes; its figures as JSON through a file."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        worker = [str(Path(__file__).resolve()), "--worker", what, "--path", str(path), "--out", out.name, *argv]
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        launcher = [] if what == "single" else launcher
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, *launcher, *worker], check=True, env=env, cwd=ROOT)
        return json.loads(Path(out.name).read_text())


def print_table(
    title: str, figures: dict, names=("float32", "bfloat16"), labels=("float32", "bfloat16", "bf16 / fp32")
):
    """Each forward's median ms for the two `names` of `figures`, and the second's time over the first's."""
    print(f"\n#### {title}\n")
    print(f"| forward | {labels[0]} ms (median) | {labels[1]} ms (median) | {labels[2]} time |")
    print("|---|---|---|---|")
    for what, first in figures[names[0]].items():
        a, b = statistics.median(first), statistics.median(figures[names[1]][what])
        print(f"| {what} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")


def parsed_arguments(description: str, rounds: int) -> argparse.Namespace:
    """The options this bench and `bench_packed_linear.py` share; `batch_list` holds the batches as integers."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batches", default="1,8,32,64", help="decode batch sizes (rows)")
    parser.add_argument("--prefill", type=int, default=128, help="prompt tokens (prefilled, then each row's cache)")
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (each set-up once a round)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--only", choices=("single", "tp"), help="measure one of the two set-ups")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    return args


def main() -> None:
    args = parsed_arguments(__doc__.splitlines()[0], rounds=5)
    if args.worker:
        result = run_single(args.path, args) if args.worker == "single" else run_tp(args.path, args)
        if result is not None:
            Path(args.out).write_text(json.dumps(result))
        return
    import platformdirs

    path = Path(platformdirs.user_cache_dir("shardbook")) / "models" / "smollm2-135m-instruct"
    argv = ["--batches", args.batches, "--prefill", str(args.prefill)]
    argv += ["--rounds", str(args.rounds)]
    print(cpu_features())
    print(f"load before: {os.getloadavg()[0]:.2f} (1 min); {args.rounds} interleaved rounds")
    for what in ("single", "tp") if args.only is None else (args.only,):
        title = "one process, 1 thread" if what == "single" else f"tp, {args.nproc} ranks of 1 thread"
        print_table(f"SmolLM2-135M (demo), {title}", launch(what, path, argv, args.nproc))
    print(f"\nload after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
