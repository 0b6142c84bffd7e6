"""Prefix reuse for the families whose cache is not plain attention: time to first token of each turn of a 10-turn
conversation, reuse on and off, side by side in one run.

``--family glm_moe_dsa`` (the default) is the random GLM-5 of ``bench_dsa_batch.py`` (MLA, a sparse-attention indexer
with its own key cache, a layer pattern where some layers reuse another's top-k), kept in blocks; ``gpt_oss`` (a
sliding window of 128 positions on every other layer) and ``qwen3_next`` (three Gated DeltaNet layers to one of
attention) are kept as end states. Each has tens of millions of parameters, drawn in-process, and is decoded by
rank 0's ``BatchScheduler`` in one process on one thread. Each turn's prompt is the whole history (every earlier
prompt and reply) and ``--question`` new tokens; the reply is ``--tokens`` greedy tokens with ``ignore_eos``. The
conversation runs with reuse on, then off (a fresh store), and the replies of both must be equal.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_family_prefix_reuse.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_family_prefix_reuse.py --family qwen3_next
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_family_prefix_reuse.py --family gpt_oss --turns 3 --tokens 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.tiny: the tokenizer and model writer the tests use
sys.path.insert(0, str(ROOT / "bench"))

_ATTENTION = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64)
SHAPES = {
    "gpt_oss": dict(
        **_ATTENTION, num_local_experts=16, num_experts_per_tok=4, intermediate_size=256, sliding_window=128
    ),
    "qwen3_next": dict(
        **_ATTENTION,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
}
"""The shapes of the families kept as end states (GLM-5's is `bench_dsa_batch.GLM5_SHAPE`)."""


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
    p.add_argument("--family", choices=["glm_moe_dsa", *SHAPES], default="glm_moe_dsa")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--question", type=int, default=48, help="new tokens a turn asks")
    p.add_argument("--tokens", type=int, default=32, help="tokens a turn replies")
    args = p.parse_args()

    import torch
    from bench_dsa_batch import GLM5_SHAPE
    from bench_prefix_reuse import print_turns
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardbook.rankd.generation.prefix_store import reuse_kind
    from tests.tiny import make_tiny_lm

    torch.set_num_threads(1)
    shape = GLM5_SHAPE if args.family == "glm_moe_dsa" else SHAPES[args.family]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_lm(Path(tmp) / "model", family=args.family, max_position_embeddings=4096, **shape)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    kind = reuse_kind(model)
    assert kind == ("blocks" if args.family == "glm_moe_dsa" else "ends"), kind
    params = sum(p.numel() for p in model.parameters()) / 1e6
    with torch.inference_mode():
        conversation(model, tokenizer, 1, 16, 4, reuse=False)  # warm-up
        runs = {
            name: conversation(model, tokenizer, args.turns, args.question, args.tokens, name == "on")
            for name in ("on", "off")
        }
    same = all(a["reply"] == b["reply"] for a, b in zip(runs["on"], runs["off"]))
    print(
        f"{args.family} {params:.1f}M parameters, kept as {kind}, float32, 1 thread; "
        f"{args.turns} turns of {args.question} new tokens "
        f"and {args.tokens} replied; replies equal on and off: {same}"
    )
    print_turns(runs)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
