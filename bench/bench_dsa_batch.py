"""GLM-5's architecture in the continuous batch: tok/s of 8 rows decoded together against 1 row alone.

A random ``glm_moe_dsa`` of tens of millions of parameters (MLA, a sparse-attention indexer with its own key
cache, 16 routed experts and a shared one, a dense first layer; drawn in-process, nothing fetched) is decoded
by rank 0's ``BatchScheduler`` in one process on one thread (no process group: the batch's own cost, not the
collectives'), greedy with ``ignore_eos``, the median of ``--repeats`` batches. Before issue 32 such a model
could not batch: 8 clients took turns, so their aggregate was one client's (1x).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_dsa_batch.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.tiny: the tokenizer and model writer the tests use
sys.path.insert(0, str(ROOT / "bench"))

GLM5_SHAPE = dict(
    hidden_size=512,
    num_layers=4,
    num_heads=8,
    num_kv_heads=8,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    index_n_heads=16,
    index_head_dim=64,
    index_topk=32,
    index_topk_pattern="FFSS",
    intermediate_size=1024,
)
"""A scaled-down GLM-5: its layer kinds and routing, at widths a 2-core CPU decodes quickly."""


def glm5_model(experts: str | None = None):
    """The scaled-down GLM-5 (float32, eval mode, drawn now) and its tokenizer; `experts`: transformers'
    experts_implementation, or its default."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny import make_tiny_lm

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_lm(Path(tmp) / "glm5", family="glm_moe_dsa", **GLM5_SHAPE)
        chosen = {} if experts is None else {"experts_implementation": experts}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **chosen).eval()
        return model, AutoTokenizer.from_pretrained(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--experts", default=None, help="transformers' experts_implementation (eager, grouped_mm, ...)")
    args = p.parse_args()

    import torch
    from batch_ceiling import batch_tok_s

    from shardbook.rankd.generation.batching import cache_refusal

    torch.set_num_threads(1)
    model, tokenizer = glm5_model(args.experts)
    assert cache_refusal(model) is None, cache_refusal(model)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    with torch.inference_mode():
        batch_tok_s(model, tokenizer, 1, 4)  # warm-up
        one = statistics.median(batch_tok_s(model, tokenizer, 1, args.tokens) for _ in range(args.repeats))
        many = statistics.median(batch_tok_s(model, tokenizer, args.rows, args.tokens) for _ in range(args.repeats))
    print(
        f"glm_moe_dsa {params:.1f}M parameters, float32, experts {model.config._experts_implementation}, "
        f"1 thread, {args.tokens} tokens per row: "
        f"1 row {one:.1f} tok/s, {args.rows} rows together {many:.1f} tok/s ({many / one:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
