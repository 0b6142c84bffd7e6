"""Where a continuous-batch step's time goes (issue 32, item 7): the demo model under `tp` on 2 ranks, 8 rows.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/profile_step.py [--rows 8] [--tokens 48] [--sample]

Every rank loads the model with `load_sharded` (decode tp, gloo, shared-memory sums, one thread per rank); rank 0
submits `--rows` greedy requests (sampled ones with `--sample`) to a `BatchScheduler` and runs its loop while the
followers run `follow_batch`, as the `batch` command does. Timers wrap the pieces of a step by name: the decode
forward (`batch_steps._decode`), the collectives inside it and outside (all-reduce, all-gather, broadcast,
shared-memory sums), the plan and its broadcast and the step's agreement (scheduling), sampling
(`pick_tokens`, `next_token`), and the text after it (detokenizing, stop strings, streaming: the rest of
`_advance`). Only steps where every row decodes and none joins count. Rank 0 prints the ms per step of every
rank (the table in docs/architecture.md), then greedy picks for the rows one by one against all at once
(`bench/bench_sampling.py` compares sampled ones).
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

PROMPT = "Write a long story about a dragon who learns to fly."


class Clock:
    """Seconds spent inside wrapped functions, by label, over the steps that count (`counting`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.counting = False
        self.depth: dict[str, int] = collections.defaultdict(int)

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.counting or self.depth[label]:
                return fn(*args, **kwargs)
            self.depth[label] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.depth[label] -= 1

        setattr(owner, name, timed)


def instrument(clock: Clock) -> None:
    import torch.distributed as dist

    from shardbook.rankd.generation import batch_steps, batching
    from shardbook.rankd.parallel.host_sum import HostSum

    clock.wrap(batch_steps, "_decode", "forward")
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "gather", "broadcast"):
        clock.wrap(dist, name, "collectives")
    clock.wrap(HostSum, "sum_", "collectives")
    clock.wrap(batch_steps, "broadcast_plan", "plan broadcast")
    clock.wrap(batch_steps, "_agree", "step agreement")
    clock.wrap(batching, "broadcast_plan", "plan broadcast")
    clock.wrap(batching.BatchScheduler, "_plan", "planning")
    clock.wrap(batching, "next_token", "sampling")
    clock.wrap(batching, "pick_tokens", "sampling")
    clock.wrap(batching.BatchScheduler, "_advance", "text (the rest of _advance)")


def main() -> None:
    import torch
    import torch.distributed as dist

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.generation import batch_steps, batching
    from shardbook.rankd.loading.load_sharded import load_sharded

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--sample", action="store_true", help="sampled rows (temperature 0.7, top-p 0.9), not greedy")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import platformdirs

    path = args.model or str(Path(platformdirs.user_cache_dir("shardbook")) / "models" / "smollm2-135m-instruct")
    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=path, dtype="float32"), parallel=ParallelConfig(decode="tp")
    )
    loaded = load_sharded(config, device="cpu")
    clock = Clock()
    instrument(clock)
    decoding = {"steps": 0}
    original = batch_steps.execute_step

    def counted(state, plan, **kwargs):  # count only the steps where every row decodes and none joins
        clock.counting = bool(plan.decode) and not plan.join and plan.chunk is None and len(plan.decode) == args.rows
        decoding["steps"] += clock.counting
        start = time.perf_counter()
        try:
            return original(state, plan, **kwargs)
        finally:
            clock.seconds["execute_step"] += (time.perf_counter() - start) * clock.counting

    batch_steps.execute_step = counted
    batching.execute_step = counted
    dist.barrier()
    if dist.get_rank() == 0:
        text = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
        )
        ids = loaded.tokenizer(text)["input_ids"]
        scheduler = batching.BatchScheduler(loaded.tokenizer, max_sequences=args.rows)
        texts = collections.defaultdict(str)
        for row in range(args.rows):
            sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "seed": row} if args.sample else {}
            request = batching.SequenceRequest(
                prompt_ids=list(ids), max_new_tokens=args.tokens, ignore_eos=True, **sampling
            )
            scheduler.submit(request, on_text=lambda text, row=row: texts.__setitem__(row, texts[row] + text))
        start = time.perf_counter()
        scheduler.run(loaded.model, "cpu")
        wall = time.perf_counter() - start
    else:
        start = time.perf_counter()
        batching.follow_batch(loaded.model, "cpu")
        wall = time.perf_counter() - start
    report(clock, decoding["steps"], wall)
    if dist.get_rank() == 0:
        print(sampling_comparison(loaded.model.config.vocab_size, args.rows))
    dist.destroy_process_group()


def sampling_comparison(vocab: int, rows: int) -> str:
    """ms to pick `rows` greedy tokens from a step's logits: row by row (`next_token`, the batch's way before
    `greedy_tokens`) against one argmax for all of them."""
    import torch

    from shardbook.rankd.generation.sampling import greedy_tokens, next_token
    from shardbook.rankd.generation.sequences import SequenceRequest

    logits = torch.randn(rows, vocab)
    requests = [SequenceRequest(prompt_ids=[1])] * rows
    per_row = min(
        timed_ms(lambda: [next_token(logits[i], requests[i], [], None) for i in range(rows)]) for _ in range(20)
    )
    batched = min(timed_ms(lambda: greedy_tokens(logits, requests, [0] * rows)) for _ in range(20))
    return f"greedy picks for {rows} rows of {vocab} logits: row by row {per_row:.2f} ms, all at once {batched:.2f} ms"


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def report(clock: Clock, steps: int, wall: float) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    per_step = {label: seconds * 1e3 / max(1, steps) for label, seconds in clock.seconds.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, per_step)
    if rank != 0:
        return
    print(f"\n{steps} decode steps of every row counted; the whole run {wall:.1f} s")
    labels = sorted({label for figures in every for label in figures})
    print("| ms per step | " + " | ".join(f"rank {r}" for r in range(len(every))) + " |")
    print("|---|" + "---|" * len(every))
    for label in labels:
        print(f"| {label} | " + " | ".join(f"{figures.get(label, 0.0):.2f}" for figures in every) + " |")


if __name__ == "__main__":
    main()
