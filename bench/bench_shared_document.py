"""One document, many questions sent together (an evaluation harness's shape): the paged batch's kept blocks
shared by every row (`rankd/generation/block_pool.py`) against prefix reuse off, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_shared_document.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_shared_document.py --document 2048 --questions 32 --rounds 1

The demo model (SmolLM2-135M, float32, one thread) and rank 0's scheduler in one process (the real batch path,
paged where the C compiler builds the decode kernel). Each round serves the same `--questions` requests (the
document's tokens, then a question of 24 tokens; greedy, `--tokens` each, all submitted at once) with reuse off and
with reuse on (the store emptied first: the first request's blocks are kept as it joins, the others start from
them), alternating. The table gives the wall time to serve them all, the time to first token (p50, max), the
prompt tokens prefilled, and the cache's blocks at its fullest: those held in the pool against the rows' blocks
counted one by one (what each row would hold with no sharing), with their MB. The replies of both must be equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_growing_cache import demo_model_one_thread


def requests(document: int, questions: int, tokens: int) -> list:
    import torch

    from shardbook.rankd.generation.batching import SequenceRequest

    generator = torch.Generator().manual_seed(0)
    text = torch.randint(10, 10_000, (document,), generator=generator).tolist()
    asks = [torch.randint(10, 10_000, (24,), generator=generator).tolist() for _ in range(questions)]
    return [SequenceRequest(prompt_ids=text + ask, max_new_tokens=tokens, ignore_eos=True) for ask in asks]


def serve(model, tokenizer, batch: list, reuse: bool) -> dict:
    """Serve `batch` at once: seconds, first-token times, prompt tokens prefilled, the fullest pool's blocks."""
    from shardbook.rankd.generation.batch_steps import BatchState
    from shardbook.rankd.generation.batching import BatchScheduler
    from shardbook.rankd.generation.paged_layers import block_table
    from shardbook.rankd.generation.prefix_store import prefix_store

    prefix_store(model).trim(0)
    fullest, append = {"held": 0, "rows": 0, "block_bytes": 0}, BatchState.append

    def measuring(self, cache, mask, shared=None) -> None:
        append(self, cache, mask, shared)
        table = block_table(self.cache)
        if table is not None and table.held_blocks > fullest["rows"]:
            pool = table.pool
            block = sum(p[0].nbytes for pools in pool.pools.values() for p in pools.values())
            fullest.update(held=pool.capacity - len(pool.free), rows=table.held_blocks, block_bytes=block)

    BatchState.append = measuring
    try:
        scheduler = BatchScheduler(tokenizer, max_sequences=len(batch), context=8192, prefix_tokens=8192 * reuse)
        start = time.perf_counter()
        handles = [scheduler.submit(request) for request in batch]
        scheduler.run(model, "cpu")
        seconds = time.perf_counter() - start
    finally:
        BatchState.append = append
    results = [handle.wait(0) for handle in handles]
    assert all(result.error is None for result in results), [result.error for result in results]
    return {
        "s": seconds,
        "ttft": [result.time_to_first_token_s for result in results],
        "prefilled": sum(len(r.prompt_ids) for r in batch) - sum(result.cached_tokens for result in results),
        "tokens": [result.token_ids for result in results],
        **fullest,
    }


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--document", type=int, default=1024)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model, path = demo_model_one_thread()
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = requests(args.document, args.questions, args.tokens)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for reuse in (False, True):
            runs[reuse].append(serve(model, tokenizer, batch, reuse))
    assert runs[True][0]["tokens"] == runs[False][0]["tokens"], "the replies differ with reuse on"
    print(f"SmolLM2-135M, float32, 1 thread; a {args.document}-token document, {args.questions} questions of 24")
    print(f"tokens, {args.tokens} tokens each, sent together; median of {args.rounds} rounds\n")
    columns = "s to serve all | TTFT p50 / max s | tokens prefilled | blocks held / rows' | MB held / rows'"
    print(f"| prefix reuse | {columns} |")
    print("|---|---|---|---|---|---|")
    for reuse, rounds in runs.items():
        seconds = statistics.median(run["s"] for run in rounds)
        ttft = [statistics.median(run["ttft"]) for run in rounds], [max(run["ttft"]) for run in rounds]
        last, mb = rounds[-1], 1 / 2**20
        print(
            f"| {'on, blocks shared' if reuse else 'off'} | {seconds:.1f} | {statistics.median(ttft[0]):.2f} / "
            f"{statistics.median(ttft[1]):.2f} | {last['prefilled']} | {last['held']} / {last['rows']} | "
            f"{last['held'] * last['block_bytes'] * mb:.0f} / {last['rows'] * last['block_bytes'] * mb:.0f} |"
        )
    off, on = (statistics.median(run["s"] for run in runs[reuse]) for reuse in (False, True))
    print(f"\nreuse on serves them in {on / off:.2f}x the time of reuse off")


if __name__ == "__main__":
    main()
