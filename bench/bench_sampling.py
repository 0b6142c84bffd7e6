"""Sampled tokens for a step's rows (issue 32, item 7): shardbook's all-rows-at-once draw against the same draw row by
row (how the batch sampled before) and against transformers' warpers over the whole batch, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sampling.py              # 1, 8, 32, 64 rows
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sampling.py --rows 8,32 --repeat 30

The logits are the demo model's own (SmolLM2-135M, 49,152 tokens), one row per position of a passage, so the
distributions are as peaked as a real reply's. For each setting and batch size it prints the best of `--repeat`
timings (ms per step) of:
- row by row: transformers' warpers (temperature, top-k, top-p) and one `torch.multinomial` per row, each with
  the request's own generator, which is what the batch did before;
- transformers, batched: the same warpers over all rows at once and one `torch.multinomial` (one generator for
  the batch, so a seeded request would not draw alike alone and in a batch);
- shardbook: `sampling.pick_tokens`, every row at once, each row's own generator.
The timings are interleaved, so whatever else the machine runs falls on all three alike.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden press adapted from those used to make wine. Within fifty years presses "
    "were at work in more than two hundred cities, and the price of a book fell so far that ordinary merchants "
    "could own several. Scholars argue about how much the press changed the way people thought."
)
SETTINGS = {
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.7, top-k 50, top-p 0.9": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
}


def demo_logits(rows: int):
    """The demo model's logits at the first `rows` positions of PASSAGE (repeated as needed), float32."""
    import platformdirs
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(platformdirs.user_cache_dir("shardbook")) / "models" / "smollm2-135m-instruct"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokenizer(PASSAGE, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]
    return logits.repeat((rows + len(logits) - 1) // len(logits), 1)[:rows].contiguous()


def warpers(settings: dict):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = [TemperatureLogitsWarper(settings["temperature"])]
    if settings.get("top_k"):
        chain.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p", 1.0) < 1.0:
        chain.append(TopPLogitsWarper(settings["top_p"]))
    return LogitsProcessorList(chain)


def row_by_row(logits, settings: dict, generators: list) -> list[int]:
    import torch

    chain = warpers(settings)
    tokens = []
    for row, generator in zip(logits, generators):
        probs = torch.softmax(chain(None, row.unsqueeze(0).clone()), dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens


def transformers_batched(logits, settings: dict, generator) -> list[int]:
    import torch

    probs = torch.softmax(warpers(settings)(None, logits.clone()), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()


def shardbook_batched(logits, requests: list, generators: list) -> list[int]:
    from shardbook.rankd.generation.sampling import pick_tokens

    return pick_tokens(logits, requests, [[] for _ in requests], generators)


def elapsed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(logits, settings: dict, repeat: int) -> tuple[float, float, float]:
    import torch

    from shardbook.rankd.generation.sequences import SequenceRequest

    rows = len(logits)
    requests = [SequenceRequest(prompt_ids=[0], do_sample=True, **settings)] * rows
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    one = torch.Generator().manual_seed(0)
    figures = [[], [], []]
    for _ in range(repeat):  # interleaved
        figures[0].append(elapsed_ms(lambda: row_by_row(logits, settings, generators)))
        figures[1].append(elapsed_ms(lambda: transformers_batched(logits, settings, one)))
        figures[2].append(elapsed_ms(lambda: shardbook_batched(logits, requests, generators)))
    return min(figures[0]), min(figures[1]), min(figures[2])


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    batches = [int(n) for n in args.rows.split(",")]
    logits = demo_logits(max(batches))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), vocabulary {logits.shape[-1]}")
    print("| setting | rows | row by row ms | transformers batched ms | shardbook ms | row by row / shardbook |")
    print("|---|---|---|---|---|---|")
    for name, settings in SETTINGS.items():
        for rows in batches:
            old, batched, ours = measure(logits[:rows], settings, args.repeat)
            print(f"| {name} | {rows} | {old:.2f} | {batched:.2f} | {ours:.2f} | {old / ours:.1f}x |")


if __name__ == "__main__":
    main()
