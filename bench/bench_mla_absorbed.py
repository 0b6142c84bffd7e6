"""MLA's decode step over the cached latents (`rankd/generation/latent_attention.py`) against transformers'
expansion of every cached latent into keys and values, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_mla_absorbed.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_mla_absorbed.py --mixes 8x256,1x2048+31x128 --steps 16

bench_dsa_batch's scaled-down GLM-5 (MLA with an indexer, float32, one thread) on the real batch path
(`BatchState`, `execute_step`): each mix's rows join one paged batch and one left-padded batch (bench_paged_cache's
`batch`), then each batch decodes `--steps` steps, every step with the latents attended over directly and one
with them expanded (`SHARDBOOK_MLA_ABSORBED=0`), alternating, so the machine's noise falls on both alike. The
table gives the median ms per step and the ratio. Then `--pieces`: a prompt's last piece of new tokens over a
history (a conversation's next turn seeded from kept blocks, or a chunked prompt's next chunk), the history fed
first untimed, the piece timed, the two modes alternating. Then `--alone`: one reply of 32 greedy tokens
generated alone (`engine.generate`, the path of `%%chat --no-batch` and the terminal chat) after a prompt of
about that many tokens: its decode tok/s in each mode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench_dsa_batch import glm5_model
from bench_paged_cache import batch, step
from bench_ragged_attention import parse_mix


def timed_steps(state, steps: int) -> dict[str, float]:
    """Median ms of a decode step of `state`, by mode (absorbed, expanded), the two alternating."""
    from shardbook.rankd.generation import latent_attention

    times: dict[str, list[float]] = {"1": [], "0": []}
    for _ in range(steps):
        for switch, seconds in times.items():
            os.environ[latent_attention.SWITCH] = switch
            seconds.append(step(state))
    os.environ.pop(latent_attention.SWITCH)
    return {switch: statistics.median(seconds) * 1e3 for switch, seconds in times.items()}


def piece_ms(model, history: int, new: int) -> float:
    """Seconds of feeding `new` tokens into a one-row prompt cache that holds `history` tokens (fed untimed)."""
    import torch

    from shardbook.rankd.generation.batch_steps import BatchState, Chunk, StepPlan, execute_step

    top = min(1000, model.config.vocab_size)
    tokens = torch.randint(10, top, (history + new,), generator=torch.Generator().manual_seed(history)).tolist()
    state, starts = BatchState(model, torch.device("cpu")), [*range(0, history, 2048), history]
    with torch.no_grad():
        for start, end in zip(starts, [*starts[1:], history + new]):
            chunk = Chunk(tokens[start:end], start, last=end == history + new, all_logits=False)
            began = time.perf_counter()
            outcome = execute_step(state, StepPlan(leave=[], decode=[], join=[], chunk=chunk))
            assert not outcome.failure, outcome.errors
    return time.perf_counter() - began


def pieces_table(model, pieces: str, repeats: int) -> None:
    from shardbook.rankd.generation import latent_attention

    print("\n| history + new tokens | over latents ms | expanded ms | ratio |\n|---|---|---|---|")
    for piece in pieces.split(","):
        history, new = (int(n) for n in piece.split("+"))
        times: dict[str, list[float]] = {"1": [], "0": []}
        for _ in range(repeats):
            for switch, seconds in times.items():
                os.environ[latent_attention.SWITCH] = switch
                seconds.append(piece_ms(model, history, new))
        os.environ.pop(latent_attention.SWITCH)
        on, off = (statistics.median(times[switch]) * 1e3 for switch in ("1", "0"))
        print(f"| {piece} | {on:.1f} | {off:.1f} | {on / off:.2f}x |")


def alone_tok_s(model, tokenizer, words: int) -> tuple[int, float]:
    """Prompt tokens and decode tok/s of one greedy 32-token reply generated alone after `words` words."""
    import threading

    from shardbook.rankd.generation.engine import GenerationRequest, generate

    text = " ".join(["the quick brown fox jumps over the lazy dog"] * (words // 9 + 1))
    request = GenerationRequest(messages=[{"role": "user", "content": text}], seed=0, max_new_tokens=32)
    result = generate(model, tokenizer, request, device="cpu", on_text=None, stop_event=threading.Event())
    return result.prompt_tokens, result.tokens_per_s


def alone_table(model, tokenizer, alone: str, repeats: int) -> None:
    from shardbook.rankd.generation import latent_attention

    model.config.max_position_embeddings = 16384  # the random model's 256 is a config value only (rope is computed)
    print("\n| prompt tokens | over latents tok/s | expanded tok/s | ratio |\n|---|---|---|---|")
    for words in (int(n) for n in alone.split(",")):
        rates: dict[str, list[float]] = {"1": [], "0": []}
        for _ in range(repeats):
            for switch, tok_s in rates.items():
                os.environ[latent_attention.SWITCH] = switch
                prompt, rate = alone_tok_s(model, tokenizer, words)
                tok_s.append(rate)
        os.environ.pop(latent_attention.SWITCH)
        on, off = (statistics.median(rates[switch]) for switch in ("1", "0"))
        print(f"| {prompt} | {on:.1f} | {off:.1f} | {on / off:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", default="1x256,8x256,1x2048+7x128,1x2048+31x128,32x512")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pieces", default="768+64,4096+64,4096+256,8192+64", help="history+new, comma-separated")
    parser.add_argument("--alone", default="60,600,2400", help="prompt words of the replies generated alone")
    args = parser.parse_args()
    model, tokenizer = glm5_model()
    print("| rows | cache | over latents ms/step | expanded ms/step | ratio |")
    print("|---|---|---|---|---|")
    for mix in args.mixes.split(","):
        for paged in (True, False):
            ms = timed_steps(batch(model, parse_mix(mix), paged), args.steps)
            layout = "paged" if paged else "left-padded"
            print(f"| {mix} | {layout} | {ms['1']:.1f} | {ms['0']:.1f} | {ms['1'] / ms['0']:.2f}x |")
    if args.pieces:
        pieces_table(model, args.pieces, repeats=3)
    if args.alone:
        alone_table(model, tokenizer, args.alone, repeats=3)


if __name__ == "__main__":
    main()
