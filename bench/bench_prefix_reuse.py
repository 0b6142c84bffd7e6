"""Prefix reuse (issue 32 item 4): time to first token of each turn of a 10-turn ``%%chat`` conversation, reuse on
and off, in one 2-rank kernel (``bench_chat.Kernel``) on the demo model.

The conversation is run twice, each on a fresh load of the model: with the config's ``prefix_cache_share`` (reuse
on), then with ``--inference.prefix_cache_share 0`` (off). Each turn is ``%%chat --output text
--max-new-tokens N`` (greedy; the first with ``--new``), so the history grows by a question and a reply a turn.
First token = the first stdout message holding reply text, from the execute_request's send (as ``bench_serve``'s
``chat`` path); prompt and cached tokens come from the status line. The replies of both runs must be equal.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_prefix_reuse.py                  # 10 turns of 64 tokens
    .venv/bin/python bench/bench_prefix_reuse.py --turns 3 --tokens 8
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat import Kernel
from bench_serve import CONFIG, MODEL

QUESTIONS = [
    "Tell me about the city of Paris.",
    "What is its most famous museum?",
    "Which river runs through it?",
    "Name three of its bridges.",
    "What is the weather like in spring?",
    "Which food should a visitor try?",
    "How do people get around the city?",
    "What is a good day trip from there?",
    "Which neighbourhood has the best views?",
    "Summarise our conversation in one sentence.",
]
STATUS = re.compile(r"\[(\d+) prompt tokens(?: \((\d+) cached\))?, (\d+) generated")


def conversation(kernel: Kernel, turns: int, tokens: int) -> list[dict]:
    rows = []
    for i in range(turns):
        new = "--new " if i == 0 else ""
        cell = kernel.ok(f"%%chat {new}--output text --max-new-tokens {tokens}\n{QUESTIONS[i % len(QUESTIONS)]}")
        texts = [
            (m["received_at"], m["content"]["text"]) for m in cell.of_type("stream") if m["content"]["name"] == "stdout"
        ]
        first = next(t for t, text in texts if text.strip() and not STATUS.search(text))
        status = STATUS.search(cell.stdout())
        rows.append(
            {
                "prompt": int(status.group(1)),
                "cached": int(status.group(2) or 0),
                "ttft_ms": (first - cell.sent_at) * 1000,
                "text": cell.stdout().rsplit("\n[", 1)[0],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        kernel = Kernel(Path(tmp))
        try:
            for name, flags in (("on", ""), ("off", " --inference.prefix_cache_share 0")):
                kernel.ok(f"%load_sharded {CONFIG}{flags}")
                kernel.ok("%%chat --new --output text --max-new-tokens 4\nHello")  # warm-up
                runs[name] = conversation(kernel, args.turns, args.tokens)
        finally:
            kernel.stop()
    same = all(a["text"] == b["text"] for a, b in zip(runs["on"], runs["off"]))
    print(f"{args.turns} turns of {args.tokens} tokens, {MODEL} on 2 ranks, %%chat; replies equal on and off: {same}")
    print_turns(runs)
    return 0 if same else 1


def print_turns(runs: dict[str, list[dict]]) -> None:
    """The turns of the conversation with reuse "on" and "off" side by side (each turn's "prompt" and "cached"
    tokens and "ttft_ms"), then each run's last turn's TTFT over its first's."""
    print(f"{'turn':>4}{'prompt':>8}{'cached':>8}{'TTFT on ms':>12}{'TTFT off ms':>13}")
    for i, (on, off) in enumerate(zip(runs["on"], runs["off"]), 1):
        print(f"{i:>4}{on['prompt']:>8}{on['cached']:>8}{on['ttft_ms']:>12.0f}{off['ttft_ms']:>13.0f}")
    for name, rows in runs.items():
        print(f"reuse {name}: TTFT of turn {len(rows)} / turn 1 = {rows[-1]['ttft_ms'] / rows[0]['ttft_ms']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
