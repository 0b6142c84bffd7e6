"""The batch's cache paged (`rankd/generation/paged_layers.py`) against left-padded and growing in place
(`growing_layers.py`, what every model had before): memory and decode-step time, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_paged_cache.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_paged_cache.py --mixes 8x256,1x4096+7x128 --steps 16

The demo model (SmolLM2-135M, float32, one thread) runs the real batch path (`BatchState`, `execute_step`): each
mix's rows join (one prefill per row length, so no prompt is padded), then `--steps` decode steps are timed after
one untimed step, with the cache paged and left-padded, interleaved for `--rounds` rounds. The table gives the best
ms per step, the cache's bytes in use (the rows' blocks; rows x the longest row) and allocated (pools; buffers with
their room), and the ratios paged / left-padded.
"""

from __future__ import annotations

import argparse
import os
import time

from bench_growing_cache import demo_model_one_thread
from bench_ragged_attention import parse_mix


def run(model, lengths: list[int], steps: int, paged: bool) -> tuple[float, int, int]:
    """(best ms per decode step, cache bytes in use, cache bytes allocated) for a batch of rows of `lengths`."""
    import torch

    from shardbook.rankd.generation import paged_layers
    from shardbook.rankd.generation.batch_steps import BatchState, StepPlan, execute_step

    os.environ[paged_layers.SWITCH] = "1" if paged else "0"
    state = BatchState(model, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in sorted(set(lengths), reverse=True):
            prompts = [
                torch.randint(10, 1000, (length,), generator=generator).tolist() for _ in range(lengths.count(length))
            ]
            execute_step(state, StepPlan(leave=[], decode=[], join=[(prompt, False) for prompt in prompts]))
        feed = [17] * state.rows
        execute_step(state, StepPlan(leave=[], decode=feed, join=[]))
        best = float("inf")
        for _ in range(steps):
            start = time.perf_counter()
            outcome = execute_step(state, StepPlan(leave=[], decode=feed, join=[]))
            best = min(best, time.perf_counter() - start)
            assert not outcome.failure, outcome.errors
    used, allocated = cache_bytes(state)
    return best * 1e3, used, allocated


def cache_bytes(state) -> tuple[int, int]:
    """The batch cache's bytes of positions in use and allocated, over every layer's keys and values."""
    from shardbook.rankd.generation.paged_layers import block_table

    table, used, allocated = block_table(state.cache), 0, 0
    for layer in state.cache.layers:
        if table is not None:
            pools = (layer.key_pool, layer.value_pool)
            per_block = sum(pool[0].nbytes for pool in pools)
            used += table.held_blocks * per_block
            allocated += sum(pool.nbytes for pool in pools)
            continue
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            used += tensor.numel() * tensor.element_size()
            allocated += layer.__dict__[f"_room_{name}"].nbytes
    return used, allocated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", default="8x256,1x4096+7x128,1x2048+31x128,32x512")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model, _ = demo_model_one_thread()
    print("| rows | paged ms/step | left-padded ms/step | ratio | in use MB paged / left-padded | allocated MB |")
    print("|---|---|---|---|---|---|")
    for mix in args.mixes.split(","):
        lengths = parse_mix(mix)
        best = {True: (float("inf"), 0, 0), False: (float("inf"), 0, 0)}
        for _ in range(args.rounds):
            for paged in (True, False):
                ms, used, allocated = run(model, lengths, args.steps, paged)
                best[paged] = (min(best[paged][0], ms), used, allocated)
        (p_ms, p_used, p_alloc), (l_ms, l_used, l_alloc) = best[True], best[False]
        mb = 1 / 2**20
        print(
            f"| {mix} | {p_ms:.1f} | {l_ms:.1f} | {p_ms / l_ms:.2f}x | {p_used * mb:.0f} / {l_used * mb:.0f} "
            f"({p_used / l_used:.2f}x) | {p_alloc * mb:.0f} / {l_alloc * mb:.0f} ({p_alloc / l_alloc:.2f}x) |"
        )


if __name__ == "__main__":
    main()
