"""Forward layouts benchmark (issue 9): decode speed, time to first token and memory of tp, gather and reshard.

    .venv/bin/python bench/bench_decode.py                         # demo model and a 42M dense Llama, 2 ranks
    .venv/bin/python bench/bench_decode.py --models smollm2 --tokens 64 --link-gbs 56 --latency-us 20

For each model, in one run: single-process `generate` (one process, one thread), then each
layout on 2 ranks (torchrun, gloo, one thread per rank), every one in fresh processes so that
its peak memory is its own. Each run is greedy with `synced_gpus` on the ranks, and records the
time of every generated token through a stopping criterion: time to first token (prefill and
the first token) and decode ms/token (the tokens after it). Memory is the peak resident set
above what the process held before loading, per rank. For `tp` the share of decode time spent
in collectives (time inside `all_reduce`/`all_gather` and shared-memory sums, waiting for the other
rank included) is reported too, and the sharded layout runs a second time with its sums over gloo
(`tp-gloo`, `SHARDBOOK_HOST_SUM=0`) instead of shared memory. Ratios printed at the end compare the
layouts measured side by side.

It ends with a cost model: bytes each rank sends per generated token, and the tok/s bound that
the link implies, for `reshard` (every layer's weights all-gathered per token) against `tp`
(two all-reduces of one token's hidden state per layer, the embedding's all-reduce and the
logits' all-gather), at GLM-744B scale on 32 ranks and for a 70B dense model on 8, and GLM-5-FP8 (issue 30)
on 16 GPUs kept as FP8 and on 32 NPUs dequantized to bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a dragon who learns to fly."
GLOO_SUMS = "-gloo"
"""Suffix of a sharded run whose sums go over gloo instead of shared memory (`SHARDBOOK_HOST_SUM=0`)."""


# ----------------------------------------------------------------------------- one measured run


def timed_generate(model, tokenizer, tokens: int, synced: bool) -> dict:
    """Greedy `generate` of exactly `tokens` tokens; the time of each token after the call started."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    messages = [{"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            synced_gpus=synced,
            stopping_criteria=StoppingCriteriaList([Stamp()]),
        )
    first, last = stamps[0], stamps[-1]
    return {"ttft_ms": (first - start) * 1e3, "decode_ms": (last - first) / (len(stamps) - 1) * 1e3}


class CollectiveClock:
    """Time spent inside torch.distributed's all_reduce and all_gather and in shared-memory sums (tp's collectives
    and synced_gpus' flag)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        from shardbook.rankd.parallel.host_sum import HostSum

        self.seconds = 0.0
        for owner, name in ((dist, "all_reduce"), (dist, "all_gather"), (HostSum, "sum_")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def warm_imports(path: str) -> None:
    """Import the model's code before the memory baseline, so peaks count the model and not the libraries."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def run_single(path: str, tokens: int) -> dict:
    """One process, one thread: `from_pretrained` then `generate`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    warm_imports(path)
    before = rss_bytes()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    timed_generate(model, tokenizer, 4, synced=False)  # warm-up
    result = timed_generate(model, tokenizer, tokens, synced=False)
    return {**result, "memory": [peak_rss_bytes() - before]}


SYNC_OPS = ("aten::nonzero", "aten::item", "aten::_local_scalar_dense")
"""Ops that make the host wait for the device, as torch.profiler names them (counted on CPU as on a device)."""


def syncs_per_decode_step(model) -> int:
    """Host syncs (`SYNC_OPS`) in one decode step of `model`: a 4-token prompt, then one token, profiled.

    On every rank together (the forward may be collective).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    from shardbook.rankd.generation.cache_keyword import cache_keyword

    ids = torch.tensor([[1, 2, 3, 4]])
    cache = {cache_keyword(model): DynamicCache(config=model.config)}
    with torch.no_grad():
        model(input_ids=ids, **cache, use_cache=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(input_ids=ids[:, -1:], **cache, use_cache=True)
    return sum(event.name in SYNC_OPS for event in prof.events())


def run_layout(path: str, layout: str, tokens: int) -> dict | None:
    """On every rank of a torchrun job: `load_sharded` in `layout`, then `generate`; rank 0 returns the figures."""
    import torch
    import torch.distributed as dist

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    warm_imports(path)
    before = rss_bytes()
    # "tp+ep": the tp layout with the experts of a MoE model split over every rank (ep_size = ranks);
    # "...-gloo": the same with every sum over gloo (measure() turned shared-memory sums off)
    layout = layout.removesuffix(GLOO_SUMS)
    parallel = (
        ParallelConfig(decode="tp", ep_size=dist.get_world_size())
        if layout == "tp+ep"
        else ParallelConfig(decode=layout)
    )
    config = ShardbookConfig(model=ModelConfig(model_name_or_path=path, dtype="float32"), parallel=parallel)
    loaded = load_sharded(config, device="cpu")
    timed_generate(loaded.model, loaded.tokenizer, 2, synced=True)  # warm-up
    clock = CollectiveClock()
    result = timed_generate(loaded.model, loaded.tokenizer, tokens, synced=True)
    total_ms = result["ttft_ms"] + result["decode_ms"] * (tokens - 1)
    syncs = syncs_per_decode_step(loaded.model)
    mine = {"memory": peak_rss_bytes() - before, "collective_share": clock.seconds * 1e3 / total_ms, "syncs": syncs}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        **result,
        "memory": [rank["memory"] for rank in every],
        "collective_share": max(rank["collective_share"] for rank in every),
        "syncs_per_step": max(rank["syncs"] for rank in every),
        "local_param_bytes": loaded.summary["local_param_bytes"],
    }


# ----------------------------------------------------------------------------- the driver


def measure(path: Path, what: str, tokens: int, nproc: int) -> dict:
    """Run `what` (single or a layout) in fresh processes; its figures as JSON through a file."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        worker = [
            str(Path(__file__).resolve()),
            "--worker",
            what,
            "--path",
            str(path),
            "--tokens",
            str(tokens),
            "--out",
            out.name,
        ]
        launcher = (
            [] if what == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDBOOK_HOST_SUM": "0" if what.endswith(GLOO_SUMS) else "1"}
        subprocess.run([sys.executable, *launcher, *worker], check=True, env=env, cwd=ROOT)
        return json.loads(Path(out.name).read_text())


GLM5_SCALED = dict(
    hidden_size=256,
    num_layers=6,
    num_heads=8,
    num_kv_heads=8,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=64,
)
"""A random glm_moe_dsa: GLM-5's structure (MLA with a query LoRA, the sparse-attention indexer, a dense first layer,
routed experts with a shared one) at hidden 256, 6 layers, 32 experts of 4 per token."""


def model_paths(names: list[str]) -> list[tuple[str, Path, str]]:
    """(title, checkpoint, the sharded layout to compare: tp, or tp+ep for a MoE model) for each name."""
    import platformdirs

    sys.path.insert(0, str(ROOT))
    from tests.tiny import make_tiny_lm

    scratch = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    models = []
    for name in names:
        if name == "smollm2":
            path = Path(platformdirs.user_cache_dir("shardbook")) / "models" / "smollm2-135m-instruct"
            models.append(("SmolLM2-135M (demo)", path, "tp"))
        elif name == "llama42m":
            path = make_tiny_lm(
                scratch / name, family="llama", hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4
            )
            models.append(("dense Llama 42M (random)", path, "tp"))
        elif name == "qwen3moe":
            path = make_tiny_lm(
                scratch / name,
                family="qwen3_moe",
                hidden_size=256,
                num_layers=6,
                num_heads=8,
                num_kv_heads=4,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=512,
                norm_topk_prob=True,
            )
            models.append(("Qwen3-MoE 27M, 8 experts, hidden 256 (random)", path, "tp+ep"))
        elif name == "glm5mla":
            path = make_tiny_lm(scratch / name, family="glm_moe_dsa", **GLM5_SCALED)
            models.append(("GLM-5 shapes (MLA, indexer, MoE) scaled to 34M (random)", path, "tp+ep"))
        else:
            models.append((name, Path(name), "tp"))
    return models


def print_model(name: str, figures: dict[str, dict], tokens: dict[str, int], sharded: str) -> None:
    single = figures["single"]
    print(f"\n### {name}\n")
    print(
        "| run | tokens | TTFT ms | decode ms/token | tok/s | vs single | peak MiB per rank | collectives "
        "| host syncs/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for what, f in figures.items():
        memory = " / ".join(f"{m / 2**20:.0f}" for m in f["memory"])
        # FSDP2's all-gathers go through other functions: only tp's share is complete
        share = f"{f['collective_share']:.0%}" if what.startswith(sharded) else "-"
        print(
            f"| {what} | {tokens[what]} | {f['ttft_ms']:.0f} | {f['decode_ms']:.1f} | {1e3 / f['decode_ms']:.1f} "
            f"| {f['decode_ms'] / single['decode_ms']:.2f}x | {memory} | {share} | {f.get('syncs_per_step', '-')} |"
        )
    tp, gather, reshard = figures[sharded], figures["gather"], figures["reshard"]
    target = 3 if sharded == "tp+ep" else 4
    print(f"\n{sharded} tok/s / reshard tok/s = {reshard['decode_ms'] / tp['decode_ms']:.1f} (target >= {target})")
    print(
        f"{sharded} peak memory / gather peak memory (max over ranks) = "
        f"{max(tp['memory']) / max(gather['memory']):.2f} (target <= 0.6)"
    )
    print(f"{sharded} ms/token / single-process ms/token = {tp['decode_ms'] / single['decode_ms']:.2f} (target <= 2.5)")
    over_gloo = figures[sharded + GLOO_SUMS]["decode_ms"] / tp["decode_ms"]
    print(f"{sharded} with gloo sums ms/token / with shared-memory sums = {over_gloo:.2f}")


# ----------------------------------------------------------------------------- the cost model


@dataclass(frozen=True)
class Shape:
    """What the cost model needs of a model and its job."""

    name: str
    params: float
    hidden: int
    layers: int
    vocab: int
    ranks: int
    dtype_bytes: int = 2
    moe_layers: int = 0
    """Layers whose MLP is a MoE block with a shared expert: three all-reduces under tp (attention, experts, shared)."""
    expert_params: float = 0.0
    weight_bytes: float = 0.0
    """Bytes per quantized weight as the ranks hold it (0: `dtype_bytes`, as every unquantized weight and value)."""
    file_bytes: float = 0.0
    """Bytes per quantized weight in the checkpoint's files (0: as held)."""
    unquantized_params: float = 0.0
    """Weights a quantized checkpoint keeps in `dtype_bytes` (embeddings, lm_head, routers, norms)."""
    expert_layouts: tuple[tuple[int, int], ...] = ((16, 2), (8, 2))
    """(ep_size, ep_fsdp_size) for the MoE weights-per-rank table: configs/glm-744b-npu.yaml's, and MindSpeed's
    training one."""

    def weights(self, params: float, held: bool = True) -> float:
        """Bytes of `params` quantizable weights as held (or, with `held` false, as stored in the files)."""
        per_weight = self.weight_bytes or self.dtype_bytes
        return params * (per_weight if held else self.file_bytes or per_weight)


FP8_BLOCK = 128
FP8_WEIGHT_BYTES = 1 + 4 / FP8_BLOCK**2
"""An e4m3 weight and its share of the float32 `weight_scale_inv` of its 128 x 128 block, as the files store it."""
FP8_HELD_BYTES = 1 + 4 / FP8_BLOCK
"""An e4m3 weight and its share of the scales `model.fp8_weights keep` holds: a float32 per row per 128 columns
(`fp8_linear`'s layout, which lets a rank's rows start inside a block)."""
GLM5_UNQUANTIZED = 2.04e9
"""GLM-5-FP8's weights kept in bf16: embeddings and lm_head (2 x 154,880 x 6144), 75 routers, norms."""
GLM5 = dict(params=744e9, hidden=6144, layers=78, vocab=154_880, moe_layers=75, expert_params=725e9)
FP8_ON_NPU = dict(file_bytes=FP8_WEIGHT_BYTES, unquantized_params=GLM5_UNQUANTIZED)
FP8_KEPT = dict(
    weight_bytes=FP8_HELD_BYTES,
    file_bytes=FP8_WEIGHT_BYTES,
    unquantized_params=GLM5_UNQUANTIZED,
    expert_layouts=((16, 1), (8, 2)),
)
SHAPES = [
    # Sizes assumed for the GLM-744B run of configs/glm-744b-npu.yaml: 744B parameters, hidden
    # 6144, 78 layers (the first 3 dense, then MoE: 256 routed experts of 3 x 6144 x 2048 weights
    # each and a shared expert, 725B expert weights in all), a 154,880-token vocabulary, bf16, on 32 ranks.
    Shape("GLM-744B MoE on 32 NPUs (bf16)", ranks=32, **GLM5),
    # GLM-5-FP8 (issue 30): the same model with every linear and routed expert in e4m3 128 x 128 blocks, read
    # as FP8 and dequantized to bf16 on NPUs (configs/glm-744b-fp8-npu.yaml), or kept as FP8 (linears and
    # routed experts, codes with per-row scales) on 16 GPUs where torch's blockwise FP8 matmul runs (sm 9.0).
    Shape("GLM-5-FP8 MoE on 32 NPUs (dequantized to bf16)", ranks=32, **GLM5, **FP8_ON_NPU),
    Shape("GLM-5-FP8 MoE on 16 GPUs (kept FP8)", ranks=16, **GLM5, **FP8_KEPT),
    Shape("70B dense on 8 devices (bf16)", 70.6e9, 8192, 80, 128_256, 8),
]


def cost_per_token(shape: Shape) -> dict[str, float]:
    """Bytes each rank sends per generated token, and collectives per token, for reshard and tp."""
    n, size = shape.ranks, shape.dtype_bytes
    ring = 2 * (n - 1) / n  # a ring all-reduce sends this many times the tensor per rank
    held = shape.weights(shape.params - shape.unquantized_params) + shape.unquantized_params * size
    reshard = held * (n - 1) / n  # all-gather: each rank sends its shard to n - 1 others
    hidden = shape.hidden * size
    all_reduces = 2 * shape.layers + shape.moe_layers + 1  # two per layer, one more per MoE layer, the embedding's
    tp = all_reduces * ring * hidden + shape.vocab / n * size * (n - 1)  # + the logits' all-gather
    return {"reshard": reshard, "tp": tp, "reshard_ops": shape.layers + 1, "tp_ops": all_reduces + 1}


def print_cost_model(link_gbs: float, latency_us: float) -> None:
    print(f"\n### Cost model: link {link_gbs:g} GB/s per rank, {latency_us:g} us per collective\n")
    print("| model | reshard bytes/token/rank | tp bytes/token/rank | reshard tok/s bound | tp tok/s bound | ratio |")
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        cost = cost_per_token(shape)
        bounds = {
            layout: 1 / (cost[layout] / (link_gbs * 1e9) + cost[f"{layout}_ops"] * latency_us * 1e-6)
            for layout in ("reshard", "tp")
        }
        print(
            f"| {shape.name} | {_bytes(cost['reshard'])} | {_bytes(cost['tp'])} | {bounds['reshard']:.3g} "
            f"| {bounds['tp']:.3g} | {bounds['tp'] / bounds['reshard']:.0f}x |"
        )
    print("\n(communication only: compute and memory bandwidth bound tp further; reshard is bound by the link.)")
    print_expert_weights()


def print_expert_weights() -> None:
    """Expert and dense weight bytes per rank of each MoE shape, for each expert layout, and what a rank reads from
    the checkpoint's files (its slices, as stored)."""
    print(
        "\n| model | ep_size x ep_fsdp_size | expert copies | expert GB per rank | dense GB per rank "
        "| total GB per rank | read from files GB per rank |"
    )
    print("|---|---|---|---|---|---|---|")
    for shape in (shape for shape in SHAPES if shape.expert_params):
        dense_params, unquantized = shape.params - shape.expert_params, shape.unquantized_params * shape.dtype_bytes
        dense = (shape.weights(dense_params - shape.unquantized_params) + unquantized) / shape.ranks
        dense_read = (shape.weights(dense_params - shape.unquantized_params, held=False) + unquantized) / shape.ranks
        for ep, efsdp in shape.expert_layouts:
            copies = shape.ranks // (ep * efsdp)
            experts = shape.weights(shape.expert_params) / (ep * efsdp)
            read = shape.weights(shape.expert_params, held=False) / (ep * efsdp) + dense_read
            print(
                f"| {shape.name} | {ep} x {efsdp} | {copies} | {experts / 1e9:.1f} | {dense / 1e9:.1f} "
                f"| {(experts + dense) / 1e9:.1f} | {read / 1e9:.1f} |"
            )


def glm5_per_rank(
    ranks: int = 32, ep_size: int = 16, ep_fsdp_size: int = 2, dtype_bytes: int = 2, fp8_kept: bool = False
) -> dict:
    """GLM-5 (GlmMoeDsaConfig defaults) under tp, from shardbook's own plan on a meta model: per rank, weights,
    the part kept whole, the bytes read from GLM-5-FP8's files, KV cache at 4k and 32k tokens, and the bytes sent
    per generated token. With `fp8_kept`, what `model.fp8_weights keep` keeps (`_kept_by_keep`: every linear and
    routed expert GLM-5-FP8 stores in e4m3) stays e4m3 with its per-row scales."""
    import torch
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    from shardbook.rankd.parallel.attention_split import kv_cache_bytes_per_token
    from shardbook.rankd.parallel.declared_plans import EXPERTS, ROW, module_plan
    from shardbook.rankd.parallel.expert_parallel import ExpertLayout
    from shardbook.rankd.parallel.tensor_parallel import attention_splits, plan_tp

    config = GlmMoeDsaConfig()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = plan_tp(model, ranks, ExpertLayout.of(ranks, ep_size, ep_fsdp_size))
    params = dict(model.named_parameters())

    def part_bytes(name: str, rank: int | None) -> tuple[float, float]:
        """Bytes of rank `rank`'s part of `name` (None: the whole tensor), as held and as read from the FP8 files."""
        selection = plan[name].selections[rank] if rank is not None and name in plan else None
        shape = params[name].shape
        ranges = selection or [None] * len(shape)
        numel = _numel(size if r is None else sum(len(piece) for piece in r) for size, r in zip(shape, ranges))
        if not _fp8_in_glm5(name, shape):
            return numel * dtype_bytes, numel * dtype_bytes
        leading = _numel(size if r is None else sum(len(piece) for piece in r) for size, r in zip(shape, ranges[:-2]))
        blocks = leading * _numel(_blocks(size, r) for size, r in zip(shape[-2:], ranges[-2:]))
        read = numel + 4 * blocks  # e4m3 codes and the float32 scales of the blocks the slice touches
        columns = shape[-1] if ranges[-1] is None else sum(len(piece) for piece in ranges[-1])
        kept = numel + 4 * (numel // columns) * _blocks(shape[-1], ranges[-1])  # a scale per held row per block
        return (kept if fp8_kept and _kept_by_keep(model, name) else numel * dtype_bytes), read

    whole = sum(part_bytes(name, None)[0] for name in params if name not in plan)
    local = [[part_bytes(name, r) for name in params] for r in range(ranks)]
    weights = [sum(h for h, _ in rank) for rank in local]
    read = [sum(f for _, f in rank) for rank in local]
    kinds = list(module_plan(model).values())
    ring, hidden = 2 * (ranks - 1) / ranks, config.hidden_size * dtype_bytes
    all_reduces = kinds.count(ROW) + kinds.count(EXPERTS) + 1  # row-parallel layers, expert sets, the embedding
    traffic = all_reduces * ring * hidden + config.vocab_size / ranks * dtype_bytes * (ranks - 1)
    kv = kv_cache_bytes_per_token(model, attention_splits(model, ranks), 0, dtype_bytes)
    return {
        "params": sum(p.numel() for p in params.values()),
        "weights": max(weights),
        "whole": whole,
        "read_fp8": max(read),
        "kv_per_token": kv,
        "kv_4k": kv * 4096,
        "kv_32k": kv * 32768,
        "collectives": all_reduces + 1,
        "traffic": traffic,
    }


GLM5_ROWS = [
    ("GLM-5 bf16 on 32 NPUs", 32, 16, 2, False),
    ("GLM-5-FP8 on 32 NPUs, dequantized to bf16", 32, 16, 2, False),
    ("GLM-5-FP8 on 16 GPUs, kept FP8", 16, 16, 1, True),
]
"""(row, ranks, ep_size, ep_fsdp_size, FP8 kept) of the GLM-5 table."""


def print_glm5() -> None:
    rows = [
        (title, ep, efsdp, glm5_per_rank(ranks, ep, efsdp, fp8_kept=kept))
        for title, ranks, ep, efsdp, kept in GLM5_ROWS
    ]
    print(f"\n### GLM-5 (GlmMoeDsaConfig(), {rows[0][-1]['params'] / 1e9:.1f}B parameters) under tp\n")
    print(
        "| checkpoint on ranks | ep_size x ep_fsdp_size | weights/rank | kept whole/rank | read from files/rank "
        "| KV cache/token/rank | KV 4k | KV 32k | collectives/token | sent/token/rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for title, ep, efsdp, f in rows:
        read = f["weights"] if title.startswith("GLM-5 bf16") else f["read_fp8"]  # the bf16 release reads as held
        print(
            f"| {title} | {ep} x {efsdp} | {_bytes(f['weights'])} | {_bytes(f['whole'])} | {_bytes(read)} "
            f"| {_bytes(f['kv_per_token'])} | {_bytes(f['kv_4k'])} | {_bytes(f['kv_32k'])} | {f['collectives']} "
            f"| {_bytes(f['traffic'])} |"
        )
    print(
        f"\n(GLM-5-FP8: every linear and routed expert of the layers in e4m3 with a float32 scale per {FP8_BLOCK} x "
        f"{FP8_BLOCK} block, routers, the indexer's weights_proj, norms, embeddings and lm_head in bf16; kept FP8, "
        f"all of those e4m3 weights stay codes, with a float32 scale per row per {FP8_BLOCK} columns; KV cache and "
        "activations bf16.)"
    )


def _fp8_in_glm5(name: str, shape) -> bool:
    """Whether GLM-5-FP8 stores `name` in e4m3 blocks: the linears and experts of the layers, not the routers (`gate`),
    the indexer's `weights_proj`, norms, embeddings or lm_head."""
    kept = ("mlp.gate.weight", "weights_proj.weight")
    return name.startswith("model.layers.") and len(shape) >= 2 and not name.endswith(kept) and "norm" not in name


def _kept_by_keep(model, name: str) -> bool:
    """Whether `model.fp8_weights keep` holds `name`, stored in e4m3 blocks, as FP8 (`fp8_keep.FP8Keeping.module_of`
    on the laid-out model): a linear layer's weight, or a fused routed experts tensor in transformers' layout."""
    from torch import nn

    from shardbook.rankd.parallel.biased_experts import has_expert_biases
    from shardbook.rankd.parallel.expert_parallel import expert_weights_problem
    from shardbook.rankd.parallel.fp8_experts import EXPERT_WEIGHTS

    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in EXPERT_WEIGHTS:
        return not has_expert_biases(module) and expert_weights_problem(module) is None
    return leaf == "weight" and type(module) is nn.Linear


def _blocks(size: int, ranges) -> int:
    """The 128-wide blocks of a dim of `size` that `ranges` touch (None: all of it)."""
    if ranges is None:
        return -(-size // FP8_BLOCK)
    return len(
        {i for piece in ranges if len(piece) for i in range(piece.start // FP8_BLOCK, (piece[-1]) // FP8_BLOCK + 1)}
    )


def _numel(shape) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default="smollm2,llama42m,qwen3moe",
        help="smollm2, llama42m, qwen3moe, glm5mla or checkpoint directories",
    )
    parser.add_argument("--tokens", type=int, default=32, help="tokens per run (single, gather, tp)")
    parser.add_argument("--tokens-reshard", type=int, default=12, help="tokens per run with reshard (slow)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--link-gbs", type=float, default=56.0, help="link bandwidth per rank for the cost model, GB/s")
    parser.add_argument("--latency-us", type=float, default=20.0, help="latency of one collective, microseconds")
    parser.add_argument("--cost-only", action="store_true", help="print only the cost models (no runs)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = (
            run_single(args.path, args.tokens)
            if args.worker == "single"
            else run_layout(args.path, args.worker, args.tokens)
        )
        if result is not None:
            Path(args.out).write_text(json.dumps(result))
        return
    tokens = {
        "single": args.tokens,
        "gather": args.tokens,
        "tp": args.tokens,
        "tp+ep": args.tokens,
        "tp-gloo": args.tokens,
        "tp+ep-gloo": args.tokens,
        "reshard": args.tokens_reshard,
    }
    if args.cost_only:
        print_cost_model(args.link_gbs, args.latency_us)
        print_glm5()
        return
    print(f"{args.nproc} ranks, gloo, 1 thread per process; prompt {PROMPT!r}; greedy")
    for name, path, sharded in model_paths(args.models.split(",")):
        runs = ("single", "gather", sharded, sharded + GLOO_SUMS, "reshard")
        figures = {what: measure(path, what, tokens[what], args.nproc) for what in runs}
        print_model(name, figures, tokens, sharded)
    print_cost_model(args.link_gbs, args.latency_us)
    print_glm5()


if __name__ == "__main__":
    main()
