"""Decode attention over a batch whose rows differ in length, three cache layouts side by side (issue 32, item 5):
what a layout where memory follows each row's own length would cost or save per decode step on a CPU.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_ragged_attention.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_ragged_attention.py --rounds 3 --mixes 8x512

One attention layer of the demo model's shape (9 query heads over 3 key/value heads of 64, float32, one thread), one
query token per row, timed with `scaled_dot_product_attention` under three layouts of the same keys and values:

* padded: one tensor of rows x the longest row, left-padded, masked (the batch's cache today);
* paged: 16-token blocks in one pool and a block table per row; each step gathers every row's blocks into a
  padded tensor and attends over it (what transformers' `paged|sdpa` does on a CPU);
* per row: each row's own tensor of its own length, one attention call per row (no padding, no gather);
* C kernel: the padded tensors read by `rankd/generation/decode_attention.py`, every row and head in one call,
  each row from its first own column (what the batch's decode step does on a CPU where the kernel is built).

A mix `RxL` is R rows of L tokens; `+` joins mixes (`31x256+1x8192`: one long prompt among short ones). The table
gives each layout's best microseconds per layer and step over `--rounds` interleaved rounds, the bytes of keys
and values each layout holds, and each layout's time over the padded one's. A decode step of the demo model runs
30 such layers.

Then the whole decode step of the demo model (one process, float32, one thread) over `--model-mixes` (smaller:
each is prefilled once, padded), its cache left-padded and growing in place as the batch's is, with transformers'
padded attention and with the batch's row-by-row attention (`rankd/generation/row_attention.py`, which goes row by
row only where at least a quarter of the columns are padding): best ms per step of `--steps` (after one untimed
step), interleaved, and the logits' largest difference. `--no-model` skips it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardbook.rankd.generation.decode_attention import decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYOUTS = ("padded", "paged", "per row", "kernel")
PATHS = ("padded", "row by row", "kernel")
"""The demo model's decode step: transformers' padded attention, the batch's row-by-row sdpa where padding is most
(the kernel switched off), the batch's C kernel."""


def parse_mix(text: str) -> list[int]:
    """`31x256+1x8192` -> 31 lengths of 256 and one of 8192."""
    lengths = []
    for part in text.split("+"):
        rows, length = part.split("x")
        lengths += [int(length)] * int(rows)
    return lengths


def padded_layout(lengths: list[int]) -> dict:
    longest, rows = max(lengths), len(lengths)
    keys, values = (torch.randn(rows, KV_HEADS, longest, HEAD_DIM) for _ in range(2))
    mask = torch.arange(longest) >= (longest - torch.tensor(lengths))[:, None]
    return {"keys": keys, "values": values, "mask": mask[:, None, None, :], "bytes": 2 * keys.nbytes}


def paged_layout(lengths: list[int]) -> dict:
    blocks = [-(-length // BLOCK) for length in lengths]
    pool_keys, pool_values = (torch.randn(sum(blocks), KV_HEADS, BLOCK, HEAD_DIM) for _ in range(2))
    widest = max(blocks)
    table = torch.zeros(len(lengths), widest, dtype=torch.long)
    start = 0
    for row, count in enumerate(blocks):
        table[row, widest - count :] = torch.arange(start, start + count)  # left-aligned like the padded layout
        start += count
    positions = torch.arange(widest * BLOCK)
    mask = positions >= (widest * BLOCK - torch.tensor(lengths))[:, None]
    nbytes = 2 * pool_keys.nbytes
    return {"pool": (pool_keys, pool_values), "table": table, "mask": mask[:, None, None, :], "bytes": nbytes}


def per_row_layout(lengths: list[int]) -> dict:
    rows = [tuple(torch.randn(1, KV_HEADS, length, HEAD_DIM) for _ in range(2)) for length in lengths]
    return {"rows": rows, "bytes": sum(2 * keys.nbytes for keys, _ in rows)}


def gathered(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The rows' blocks as one padded tensor: rows x heads x (blocks x BLOCK) x dim (a copy)."""
    rows, widest = table.shape
    return pool[table].permute(0, 2, 1, 3, 4).reshape(rows, KV_HEADS, widest * BLOCK, HEAD_DIM)


def attend(layout: str, cache: dict, query: torch.Tensor) -> None:
    if layout == "padded":
        F.scaled_dot_product_attention(query, cache["keys"], cache["values"], cache["mask"], enable_gqa=True)
    elif layout == "paged":
        keys, values = (gathered(pool, cache["table"]) for pool in cache["pool"])
        F.scaled_dot_product_attention(query, keys, values, cache["mask"], enable_gqa=True)
    elif layout == "per row":
        for row, (keys, values) in enumerate(cache["rows"]):
            F.scaled_dot_product_attention(query[row : row + 1], keys, values, enable_gqa=True)
    else:  # the padded tensors, each row read from its first own column on
        decode_attention(query, cache["keys"], cache["values"], cache["starts"], HEAD_DIM**-0.5)


def best_us(layout: str, cache: dict, query: torch.Tensor, repeats: int) -> float:
    attend(layout, cache, query)
    start = time.perf_counter()
    for _ in range(repeats):
        attend(layout, cache, query)
    return (time.perf_counter() - start) / repeats * 1e6


def measure(mix: str, rounds: int, repeats: int) -> dict:
    lengths = parse_mix(mix)
    padded = padded_layout(lengths)
    kernel = {**padded, "starts": max(lengths) - torch.tensor(lengths)}
    caches = {"padded": padded, "paged": paged_layout(lengths), "per row": per_row_layout(lengths), "kernel": kernel}
    query = torch.randn(len(lengths), HEADS, 1, HEAD_DIM)
    times = {layout: float("inf") for layout in LAYOUTS}
    with torch.no_grad():
        for _ in range(rounds):
            for layout in LAYOUTS:
                times[layout] = min(times[layout], best_us(layout, caches[layout], query, repeats))
    return {layout: (times[layout], caches[layout]["bytes"]) for layout in LAYOUTS}


def prefilled(model, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Rows of `lengths` random tokens, left-padded, prefilled at their own positions: ids, mask and cache."""
    from transformers import DynamicCache

    rows, columns = len(lengths), max(lengths)
    ids = torch.randint(10, 1000, (rows, columns), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(columns) >= columns - torch.tensor(lengths)[:, None]).long()
    cache = DynamicCache(config=model.config)
    model(ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), past_key_values=cache)
    return ids, mask, cache


def demo_step_ms(model, batch: tuple, lengths: list[int], path: str, steps: int) -> tuple[float, torch.Tensor]:
    """Best ms of a decode step over a copy of the `prefilled` batch (each row at its own positions) and the last
    step's logits, with the attention `path` (one of PATHS)."""
    from shardbook.rankd.generation import decode_attention as kernel
    from shardbook.rankd.generation.growing_layers import grow_in_place
    from shardbook.rankd.generation.row_attention import by_rows

    ids, mask, cache = batch[0], batch[1], copy.deepcopy(batch[2])
    grow_in_place(cache)
    built = kernel.available
    kernel.available = built if path == "kernel" else lambda: False
    try:
        with by_rows() if path != "padded" else contextlib.nullcontext():
            best, logits = _timed_steps(model, ids, mask, cache, lengths, steps)
    finally:
        kernel.available = built
    return best, logits


def _timed_steps(model, ids, mask, cache, lengths: list[int], steps: int) -> tuple[float, torch.Tensor]:
    best = float("inf")
    for step in range(steps + 1):
        mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=torch.long)], dim=1)
        start = time.perf_counter()
        out = model(
            ids[:, -1:],
            attention_mask=mask,
            position_ids=torch.tensor(lengths)[:, None] + step,
            past_key_values=cache,
            cache_position=torch.tensor([mask.shape[1] - 1]),
        )
        best = min(best, (time.perf_counter() - start) * 1e3) if step else best
    return best, out.logits[:, -1]


def demo_model_table(mixes: list[str], rounds: int, steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_growing_cache import demo_model_one_thread

    model, _ = demo_model_one_thread()
    print("\nthe demo model's decode step, one process, float32, one thread; best ms per step\n")
    print(
        "| rows x tokens | padded attention | row by row where padding is most | C kernel | rows / padded | "
        "kernel / padded | kernel's logits diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for mix in mixes:
        lengths = parse_mix(mix)
        times, logits = dict.fromkeys(PATHS, float("inf")), {}
        with torch.no_grad():
            batch = prefilled(model, lengths)
            for _ in range(rounds):
                for path in PATHS:
                    ms, logits[path] = demo_step_ms(model, batch, lengths, path, steps)
                    times[path] = min(times[path], ms)
        diff = (logits["kernel"] - logits["padded"]).abs().max().item()
        cells = " | ".join(f"{times[path]:.0f}" for path in PATHS)
        ratios = " | ".join(f"{times[path] / times['padded']:.2f}x" for path in PATHS[1:])
        print(f"| {mix} | {cells} | {ratios} | {diff:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", default="8x512,32x512,32x2048,31x256+1x8192,7x128+1x8192")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model-mixes", default="16x600,15x256+1x2048,31x64+1x1024,7x128+1x4096")
    parser.add_argument("--steps", type=int, default=3, help="the demo model's decode steps timed per round")
    parser.add_argument("--no-model", action="store_true", help="only the one-layer table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"one layer, {HEADS} query heads over {KV_HEADS} kv heads of {HEAD_DIM}, float32, one thread; best of")
    print(f"{args.rounds} rounds of {args.repeats}; us per layer and step (MiB of keys and values)\n")
    print(
        "| rows x tokens | padded | paged (gather) | per row | C kernel | paged / padded | per row / padded | "
        "kernel / padded |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mix in args.mixes.split(","):
        result = measure(mix, args.rounds, args.repeats)
        cells = [f"{us:.0f} ({nbytes / 2**20:.1f})" for us, nbytes in result.values()]
        padded = result["padded"][0]
        ratios = [f"{result[layout][0] / padded:.2f}x" for layout in LAYOUTS[1:]]
        print(f"| {mix} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    if not args.no_model:
        demo_model_table(args.model_mixes.split(","), min(args.rounds, 2), args.steps)


if __name__ == "__main__":
    main()
