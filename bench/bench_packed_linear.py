"""bfloat16 linears through oneDNN's packed weights against `F.linear` (rankd/parallel/packed_linear.py), on a CPU
with AMX or AVX512-BF16: each linear shape of the demo model alone, then the demo model's prefill and decode steps,
one process and `tp` on 2 ranks.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_packed_linear.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_packed_linear.py --rounds 2 --batches 1,8 --only single

One process: the model loaded once in bfloat16, and a deep copy of it packed (`pack_linears`); both measured
interleaved in the same process as `bench_dtype.py` measures (a prefill of `--prefill` tokens, decode steps of
each batch over copies of its cache), and their logits compared. `tp`: `load_sharded` (which packs at the end of
a load) in fresh 2-rank jobs with `SHARDBOOK_PACKED_LINEAR=0` and without it, alternating, `--rounds` each.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_dtype import cpu_features, measure, parsed_arguments, print_table

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))
"""(in, out) of the demo model's linears: q/o, k/v, gate/up, down, the output layer."""
TABLE = (("plain", "packed"), ("F.linear", "packed", "packed / F.linear"))


def linear_table(rows: list[int]) -> None:
    """Microseconds of one linear per shape and rows, `F.linear` against the packed weight (best of 3 x 50)."""
    import torch
    import torch.nn.functional as F

    from shardbook.rankd.parallel.packed_linear import linear, packed

    print("\n| linear (in x out) | rows | F.linear us | packed us | packed / F.linear | same bits |")
    print("|---|---|---|---|---|---|")
    for k, n in SHAPES:
        weight = torch.randn(n, k, dtype=torch.bfloat16)
        packed(weight)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            plain = best_us(lambda x=x, weight=weight: F.linear(x, weight))
            fast = best_us(lambda x=x, weight=weight: linear(x, weight))
            same = torch.equal(F.linear(x, weight), linear(x, weight))
            print(f"| {k} x {n} | {m} | {plain:.0f} | {fast:.0f} | {fast / plain:.2f}x | {same} |")


def best_us(fn, calls: int = 50) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def run_single(path: str, args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from shardbook.rankd.parallel.packed_linear import pack_linears

    torch.set_num_threads(1)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    fast = copy.deepcopy(plain)
    pack_linears(fast)
    ids = torch.randint(100, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (plain(ids).logits.float() - fast(ids).logits.float()).abs().max().item()
    print(f"one process: logits max |packed - plain| over 4 x 64 tokens: {diff}")
    return measure({"plain": plain, "packed": fast}, args.batch_list, args.prefill, args.rounds)


def run_tp(path: str, args: argparse.Namespace) -> dict | None:
    """On every rank of a torchrun job: the model loaded sharded (`tp`, packed or not by the environment)."""
    import torch
    import torch.distributed as dist

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=path, dtype="bfloat16"), parallel=ParallelConfig(decode="tp")
    )
    figures = measure({"run": load_sharded(config, device="cpu").model}, args.batch_list, args.prefill, 1)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return figures["run"] if rank == 0 else None


def tp_figures(path: Path, argv: list[str], rounds: int, nproc: int) -> dict:
    """{plain|packed: {what: [ms per round]}} from 2-rank jobs, alternating the two."""
    figures: dict = {"plain": {}, "packed": {}}
    for _ in range(rounds):
        for name, switch in (("plain", "0"), ("packed", "1")):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                worker = [str(Path(__file__).resolve()), "--worker", "tp", "--path", str(path), "--out", out.name]
                launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDBOOK_PACKED_LINEAR": switch}
                subprocess.run([*launcher, *worker, *argv], check=True, env=env, cwd=ROOT)
                for what, ms in json.loads(Path(out.name).read_text()).items():
                    figures[name].setdefault(what, []).extend(ms)
    return figures


def main() -> None:
    args = parsed_arguments(__doc__.splitlines()[0], rounds=3)
    if args.worker:
        result = run_tp(args.path, args)
        if result is not None:
            Path(args.out).write_text(json.dumps(result))
        return
    import platformdirs

    from shardbook.rankd.parallel.packed_linear import packing_available

    print(cpu_features())
    if not packing_available():
        print("no packing here: this CPU has neither AMX nor AVX512-BF16 (or SHARDBOOK_PACKED_LINEAR=0)")
        return
    print(f"load before: {os.getloadavg()[0]:.2f} (1 min); {args.rounds} interleaved rounds")
    linear_table(args.batch_list)
    path = Path(platformdirs.user_cache_dir("shardbook")) / "models" / "smollm2-135m-instruct"
    if args.only != "tp":
        print_table("SmolLM2-135M (demo), bfloat16, one process, 1 thread", run_single(str(path), args), *TABLE)
    if args.only != "single":
        argv = ["--batches", args.batches, "--prefill", str(args.prefill)]
        print_table(
            "SmolLM2-135M (demo), bfloat16, tp, 2 ranks of 1 thread", tp_figures(path, argv, args.rounds), *TABLE
        )
    print(f"\nload after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
