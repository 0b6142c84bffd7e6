"""GLM-5's architecture and prefix reuse: time to first token of each turn of a 10-turn conversation, reuse on and
off, side by side in one run.

The random ``glm_moe_dsa`` of ``bench_dsa_batch.py`` (MLA, a sparse-attention indexer with its own key cache, a layer
pattern where some layers reuse another's top-k; tens of millions of parameters, drawn in-process) is decoded by
rank 0's ``BatchScheduler`` in one process on one thread. Each turn's prompt is the whole history (every earlier
prompt and reply) and ``--question`` new tokens; the reply is ``--tokens`` greedy tokens with ``ignore_eos``. The
conversation runs with reuse on, then off (a fresh store), and the replies of both must be equal.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_dsa_prefix_reuse.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_dsa_prefix_reuse.py --turns 3 --tokens 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.tiny: the tokenizer and model writer the tests use
sys.path.insert(0, str(ROOT / "bench"))


def conversation(model, tokenizer, turns: int, question: int, tokens: int, reuse: bool) -> list[dict]:
    """Each turn's prompt length, cached tokens, time to first token (ms) and reply."""
    import torch

    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest
    from shardbook.rankd.generation.prefix_store import prefix_store

    prefix_store(model).trim(0)
    scheduler = BatchScheduler(tokenizer, context=model.config.max_position_embeddings, prefix_tokens=65536 * reuse)
    words = torch.randint(10, 200, (turns * question,), generator=torch.Generator().manual_seed(0)).tolist()
    history: list[int] = []
    rows = []
    for turn in range(turns):
        prompt = history + words[turn * question : (turn + 1) * question]
        handle = scheduler.submit(SequenceRequest(prompt_ids=prompt, max_new_tokens=tokens, ignore_eos=True))
        scheduler.run(model, "cpu")
        result = handle.wait(0)
        assert result.error is None, result.error
        rows.append(
            {
                "prompt": len(prompt),
                "cached": result.cached_tokens,
                "ttft_ms": result.time_to_first_token_s * 1e3,
                "reply": result.token_ids,
            }
        )
        history = prompt + result.token_ids
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--question", type=int, default=48, help="new tokens a turn asks")
    p.add_argument("--tokens", type=int, default=32, help="tokens a turn replies")
    args = p.parse_args()

    import torch
    from bench_dsa_batch import GLM5_SHAPE
    from bench_prefix_reuse import print_turns
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardbook.rankd.generation.prefix_store import reuse_refusal
    from tests.tiny import make_tiny_lm

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_lm(Path(tmp) / "glm5", family="glm_moe_dsa", max_position_embeddings=4096, **GLM5_SHAPE)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    assert reuse_refusal(model) is None, reuse_refusal(model)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    with torch.inference_mode():
        conversation(model, tokenizer, 1, 16, 4, reuse=False)  # warm-up
        runs = {
            name: conversation(model, tokenizer, args.turns, args.question, args.tokens, name == "on")
            for name in ("on", "off")
        }
    same = all(a["reply"] == b["reply"] for a, b in zip(runs["on"], runs["off"]))
    print(
        f"glm_moe_dsa {params:.1f}M parameters, float32, 1 thread; {args.turns} turns of {args.question} new tokens "
        f"and {args.tokens} replied; replies equal on and off: {same}"
    )
    print_turns(runs)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
