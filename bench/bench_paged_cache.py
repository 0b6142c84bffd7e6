"""The batch's cache paged (`rankd/generation/paged_layers.py`) against left-padded and growing in place
(`growing_layers.py`, what every model had before): memory and decode-step time, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_paged_cache.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_paged_cache.py --mixes 8x256,1x4096+7x128 --steps 32
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_paged_cache.py --model glm5

The demo model (SmolLM2-135M, float32, one thread; `--model glm5`: bench_dsa_batch's scaled-down GLM-5, whose MLA
latents and indexer keys are paged) runs the real batch path (`BatchState`, `execute_step`): each
mix's rows join one batch paged and one left-padded (one prefill per row length, so no prompt is padded), then the
two decode `--steps` steps each, alternating step by step. The table gives the median ms per step, the cache's
bytes in use (the rows' blocks; rows x the longest row) and allocated (pools; buffers with their room), and the
ratios paged / left-padded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench_dsa_batch import glm5_model
from bench_growing_cache import demo_model_one_thread
from bench_ragged_attention import parse_mix


def batch(model, lengths: list[int], paged: bool):
    """A batch of rows of `lengths` (joined one prefill per length, so no prompt is padded), paged or left-padded,
    after one decode step."""
    import torch

    from shardbook.rankd.generation import paged_layers
    from shardbook.rankd.generation.batch_steps import BatchState, StepPlan, execute_step

    os.environ[paged_layers.SWITCH] = "1" if paged else "0"
    state = BatchState(model, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in sorted(set(lengths), reverse=True):
            count = lengths.count(length)
            top = min(1000, model.config.vocab_size)
            prompts = [torch.randint(10, top, (length,), generator=generator).tolist() for _ in range(count)]
            outcome = execute_step(state, StepPlan(leave=[], decode=[], join=[(prompt, False) for prompt in prompts]))
            assert not outcome.failure, outcome.errors
        step(state)
    return state


def step(state) -> float:
    """One decode step of every row: its seconds."""
    import torch

    from shardbook.rankd.generation.batch_steps import StepPlan, execute_step

    start = time.perf_counter()
    with torch.no_grad():
        outcome = execute_step(state, StepPlan(leave=[], decode=[17] * state.rows, join=[]))
    assert not outcome.failure, outcome.errors
    return time.perf_counter() - start


def cache_bytes(state) -> tuple[int, int]:
    """The batch cache's bytes of positions in use and allocated, over every layer's tensors held per position (keys
    and values, or MLA's latents, and an indexer's keys)."""
    from shardbook.rankd.generation.cache_rows import position_fields
    from shardbook.rankd.generation.paged_layers import block_table

    table, used, allocated = block_table(state.cache), 0, 0
    for layer in state.cache.layers:
        if table is not None:
            pools = [layer.pool(name) for name in layer.paged_names]
            used += table.held_blocks * sum(pool[0].nbytes for pool in pools)
            allocated += sum(pool.nbytes for pool in pools)
            continue
        for name, _, _ in position_fields(layer):
            tensor = getattr(layer, name)
            used += tensor.numel() * tensor.element_size()
            allocated += layer.__dict__[f"_room_{name}"].nbytes
    return used, allocated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", default="8x256,1x4096+7x128,1x2048+31x128,32x512")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--model", choices=("demo", "glm5"), default="demo")
    args = parser.parse_args()
    model, _ = demo_model_one_thread() if args.model == "demo" else glm5_model()
    print("| rows | paged ms/step | left-padded ms/step | ratio | in use MB paged / left-padded | allocated MB |")
    print("|---|---|---|---|---|---|")
    for mix in args.mixes.split(","):
        lengths = parse_mix(mix)
        states = {paged: batch(model, lengths, paged) for paged in (True, False)}
        times = {True: [], False: []}
        for _ in range(args.steps):  # interleaved step by step: the machine's noise falls on both alike
            for paged, state in states.items():
                times[paged].append(step(state))
        (p_used, p_alloc), (l_used, l_alloc) = (cache_bytes(states[paged]) for paged in (True, False))
        p_ms, l_ms = (statistics.median(times[paged]) * 1e3 for paged in (True, False))
        mb = 1 / 2**20
        print(
            f"| {mix} | {p_ms:.1f} | {l_ms:.1f} | {p_ms / l_ms:.2f}x | {p_used * mb:.0f} / {l_used * mb:.0f} "
            f"({p_used / l_used:.2f}x) | {p_alloc * mb:.0f} / {l_alloc * mb:.0f} ({p_alloc / l_alloc:.2f}x) |"
        )


if __name__ == "__main__":
    main()
