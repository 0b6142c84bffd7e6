"""Joins and leaves of the continuous batch: the batch's cache copied whole at each (cat and index_select, what
the batch did before) against rows written into room and moved into the leaving rows' places
(`growing_layers.join_rows` / `keep_rows`), side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_batch_churn.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_batch_churn.py --rows 8,32 --contexts 256 --requests 0

Two measures on the demo model (SmolLM2-135M, float32, one thread):

* the row operations alone: a batch cache of `--rows` rows of each context length (the model's 30 layers, random
  keys and values), one row joins and then the first row leaves (the last row moves into its place), best ms of
  `--rounds` interleaved rounds;
* the batch at work: `--requests` greedy requests of 8 to 64 tokens (`ignore_eos`) after a `--prompt`-token prompt,
  all submitted at once to a batch of 32 rows, so rows leave and waiting requests join all along; tokens a second
  of the whole run, the copying path forced by making the in-place operations decline (as a tensor that is not
  the buffer's view does).
"""

from __future__ import annotations

import argparse
import contextlib
import time


def batch_cache(config, rows: int, columns: int, grow: bool):
    import torch
    from transformers import DynamicCache

    from shardbook.rankd.generation.growing_layers import grow_in_place

    cache = DynamicCache(config=config)
    if grow:
        grow_in_place(cache)
    shape = (rows, config.num_key_value_heads, columns, config.head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape), torch.randn(shape), layer)
    return cache


def row_ops_ms(config, rows: int, columns: int, grow: bool) -> tuple[float, float]:
    """(ms of one row joining, ms of the first row leaving) of a `rows` x `columns` batch cache."""
    from shardbook.rankd.generation.cache_rows import append_rows, select_rows
    from shardbook.rankd.generation.growing_layers import kept_order

    cache, joining = batch_cache(config, rows, columns, grow), batch_cache(config, 1, columns // 2, False)
    start = time.perf_counter()
    append_rows(cache, joining, columns)
    joined = time.perf_counter()
    select_rows(cache, kept_order(rows + 1, [0]), columns)
    return (joined - start) * 1e3, (time.perf_counter() - joined) * 1e3


@contextlib.contextmanager
def copying(on: bool):
    """Make the in-place row operations decline, so every join and leave copies the batch's cache (as before)."""
    from shardbook.rankd.generation import cache_rows

    saved = cache_rows.join_rows, cache_rows.keep_rows
    if on:
        cache_rows.join_rows = cache_rows.keep_rows = lambda *args: False
    try:
        yield
    finally:
        cache_rows.join_rows, cache_rows.keep_rows = saved


def churn_tok_s(model, tokenizer, requests: int, prompt: int, copy: bool) -> float:
    import torch

    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest

    ids = torch.randint(10, 1000, (requests, prompt), generator=torch.Generator().manual_seed(0)).tolist()
    scheduler = BatchScheduler(tokenizer, max_sequences=32, context=model.config.max_position_embeddings)
    lengths = [8 + (i * 37) % 57 for i in range(requests)]
    handles = [
        scheduler.submit(SequenceRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True)) for p, n in zip(ids, lengths)
    ]
    with copying(copy):
        start = time.perf_counter()
        scheduler.run(model, "cpu")
        seconds = time.perf_counter() - start
    assert all(h.wait(0).error is None for h in handles)
    return sum(lengths) / seconds


def main() -> None:
    import torch
    from bench_growing_cache import demo_model_one_thread
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,32")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args()
    model, path = demo_model_one_thread()
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(f"SmolLM2-135M's cache (float32, 1 thread): best ms of {args.rounds} rounds, one row joins then one leaves")
    print("| rows | context | join: copy | join: in place | leave: copy | leave: in place |")
    print("|---|---|---|---|---|---|")
    for rows in (int(n) for n in args.rows.split(",")):
        for columns in (int(n) for n in args.contexts.split(",")):
            runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(args.rounds):  # interleaved
                for grow in (False, True):
                    runs[grow].append(row_ops_ms(model.config, rows, columns, grow))
            (cj, cl), (gj, gl) = ([min(ms[i] for ms in runs[g]) for i in (0, 1)] for g in (False, True))
            print(
                f"| {rows} | {columns} | {cj:.1f} | {gj:.1f} ({cj / gj:.0f}x) | {cl:.1f} | {gl:.1f} ({cl / gl:.0f}x) |"
            )
    if args.requests:
        with torch.inference_mode():
            churn_tok_s(model, tokenizer, 4, 8, False)  # warm-up
            rates = {copy: [] for copy in (True, False)}
            for _ in range(2):
                for copy in (True, False):
                    rates[copy].append(churn_tok_s(model, tokenizer, args.requests, args.prompt, copy))
        best = {copy: max(r) for copy, r in rates.items()}
        print(
            f"batch of 32 at work, {args.requests} requests of 8-64 tokens after {args.prompt} prompt tokens: "
            f"copying {best[True]:.1f} tok/s, in place {best[False]:.1f} tok/s ({best[False] / best[True]:.2f}x; "
            f"runs {', '.join(f'{r:.1f}' for r in rates[True])} / {', '.join(f'{r:.1f}' for r in rates[False])})"
        )


if __name__ == "__main__":
    main()
