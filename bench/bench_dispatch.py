"""Expert dispatch when every rank holds the same tokens: one all-reduce against an all-to-all out and back.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 bench/bench_dispatch.py

Under `tp` every rank runs `generate` on the same tokens, so an MoE layer can either
- all-reduce: each rank runs its own experts on the tokens routed to them and one all-reduce of
  the layer's output (tokens x hidden) adds the partial results (what `expert_parallel` does); or
- all-to-all: each rank sends the tokens routed to another rank's experts there (dispatch) and
  gets their outputs back (combine): two all-to-alls of the routed tokens (top_k copies of each).
Both move activations only; this times the communication of one MoE layer for decode (1 token)
and prefill lengths, side by side in one run, median of many repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` runs, the ranks starting each run together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def all_reduce_layer(tokens: int, hidden: int):
    out = torch.randn(tokens, hidden)
    return lambda: dist.all_reduce(out)


def all_to_all_layer(tokens: int, hidden: int, top_k: int):
    """Dispatch and combine: each rank sends the routed copies meant for the others (an even spread)."""
    world = dist.get_world_size()
    routed = tokens * top_k
    per_peer = max(1, routed // world)
    send = torch.randn(per_peer * world, hidden)
    receive = torch.empty_like(send)

    def run() -> None:
        dist.all_to_all_single(receive, send)  # dispatch
        dist.all_to_all_single(send, receive)  # combine

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for tokens in (1, 16, 256):
        reduce_ms = timed(all_reduce_layer(tokens, args.hidden), args.repeats)
        a2a_ms = timed(all_to_all_layer(tokens, args.hidden, args.top_k), args.repeats)
        rows.append((tokens, reduce_ms, a2a_ms))
    if dist.get_rank() == 0:
        print(
            f"{dist.get_world_size()} ranks, gloo, hidden {args.hidden}, top_k {args.top_k}, median of {args.repeats}"
        )
        print("| tokens | all-reduce ms | all-to-all out and back ms | all-to-all / all-reduce |")
        print("|---|---|---|---|")
        for tokens, reduce_ms, a2a_ms in rows:
            print(f"| {tokens} | {reduce_ms:.3f} | {a2a_ms:.3f} | {a2a_ms / reduce_ms:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
