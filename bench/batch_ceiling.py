"""What the model's own forward allows a batch to gain on this machine, for bench_batching's ratio target.

Under ``gather`` every rank runs the whole forward of every step, one thread each. This runs the same
batch decode as the ranks (rank 0's ``BatchScheduler`` in one process, no server, no process group) in
two processes at once, one thread each, so both cores are as busy as under the two ranks: the tok/s
of one row alone and of ``--rows`` rows together (greedy, ``ignore_eos``, the median of ``--repeats``
batches each). Their ratio is the most batching can give at that many rows here: the
serving path can add overhead at one row (which raises its ratio), but no forward is cheaper.

Run by ``bench_batching.py`` after the kernel is gone; alone: ``python bench/batch_ceiling.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def batch_tok_s(model, tokenizer, rows: int, tokens: int) -> float:
    """Generated tokens per second of one batch of ``rows`` requests decoded together to ``tokens`` each."""
    from bench_batching import PROMPT  # here, not at the top: bench_batching imports this module

    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest

    scheduler = BatchScheduler(tokenizer)
    handles = [
        scheduler.submit(
            SequenceRequest(
                prompt_ids=tokenizer(PROMPT.format(i=i))["input_ids"], max_new_tokens=tokens, ignore_eos=True
            )
        )
        for i in range(rows)
    ]
    start = time.perf_counter()
    scheduler.run(model, "cpu")
    seconds = time.perf_counter() - start
    return sum(len(h.wait(10).token_ids) for h in handles) / seconds


def measure(rows: int, tokens: int, repeats: int) -> dict:
    import torch
    from bench_batching import MODEL_DIR
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    with torch.inference_mode():
        batch_tok_s(model, tokenizer, 1, 4)  # warm-up
        one = statistics.median(batch_tok_s(model, tokenizer, 1, tokens) for _ in range(repeats))
        many = statistics.median(batch_tok_s(model, tokenizer, rows, tokens) for _ in range(repeats))
    return {"one_tok_s": one, "many_tok_s": many}


def ceiling(rows: int, tokens: int, repeats: int = 3) -> dict:
    """Both processes' figures (started together), and the ratio of their medians."""
    argv = [sys.executable, __file__, "--worker", "--rows", str(rows), "--tokens", str(tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([*argv, "--repeats", str(repeats)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    found = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        assert proc.returncode == 0, "a ceiling worker failed"
        found.append(json.loads(out.strip().splitlines()[-1]))
    one = statistics.median(f["one_tok_s"] for f in found)
    many = statistics.median(f["many_tok_s"] for f in found)
    return {"one_tok_s": one, "many_tok_s": many, "ratio": many / one}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args.rows, args.tokens, args.repeats)))
        return 0
    found = ceiling(args.rows, args.tokens, args.repeats)
    print(
        f"forward alone, 2 processes at once, 1 thread each: {found['one_tok_s']:.2f} tok/s with 1 row, "
        f"{found['many_tok_s']:.2f} with {args.rows} ({found['ratio']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
