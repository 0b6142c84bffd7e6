"""Decode steps of a batch's cache: transformers' concatenating layers against layers that grow in place
(`rankd/generation/growing_layers.py`, what the continuous batch's cache does), side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_growing_cache.py             # demo model, 8 rows
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_growing_cache.py --rows 32 --contexts 256,1024

The demo model (SmolLM2-135M, float32, one thread) prefills `--rows` rows of each context length into a
`DynamicCache`, then times `--steps` decode steps (after one untimed step), with the cache as transformers makes
it and with its layers growing in place, interleaved for `--rounds` rounds; the table gives each one's best ms per
step and the ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def step_ms(model, rows: int, context: int, steps: int, grow: bool) -> float:
    import torch
    from transformers import DynamicCache

    from shardbook.rankd.generation.growing_layers import grow_in_place

    ids = torch.randint(10, 1000, (rows, context), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        if grow:
            grow_in_place(cache)
        token = ids[:, -1:]
        model(token, past_key_values=cache, use_cache=True)
        start = time.perf_counter()
        for _ in range(steps):
            model(token, past_key_values=cache, use_cache=True)
    return (time.perf_counter() - start) / steps * 1e3


def demo_model_one_thread():
    """The demo model (float32, eval mode) and its directory, with torch on one thread and transformers quiet."""
    import platformdirs
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    torch.set_num_threads(1)
    logging.set_verbosity_error()
    path = Path(platformdirs.user_cache_dir("shardbook")) / "models" / "smollm2-135m-instruct"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--contexts", default="256,1024,2048")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model, _ = demo_model_one_thread()
    print(f"SmolLM2-135M, float32, 1 thread, {args.rows} rows; best ms per decode step of {args.rounds} rounds")
    print("| context | concatenating (transformers) | growing in place | ratio |")
    print("|---|---|---|---|")
    for context in (int(n) for n in args.contexts.split(",")):
        plain, grown = [], []
        for _ in range(args.rounds):  # interleaved
            plain.append(step_ms(model, args.rows, context, args.steps, grow=False))
            grown.append(step_ms(model, args.rows, context, args.steps, grow=True))
        print(f"| {context} | {min(plain):.1f} | {min(grown):.1f} | {min(plain) / min(grown):.2f}x |")


if __name__ == "__main__":
    main()
