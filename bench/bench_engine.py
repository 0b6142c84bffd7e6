"""Engine overhead benchmark (issue 4): tokens/s of `rankd.engine.generate` against a bare `model.generate`.

Run on 2 ranks (gloo, one thread each)::

    python -m torch.distributed.run --nproc_per_node 2 bench/bench_engine.py --model tiny
    python -m torch.distributed.run --nproc_per_node 2 bench/bench_engine.py --model smollm2

Every rank loads the checkpoint and shards each decoder layer and the root with FSDP2, once
per `reshard_after_forward` mode. Variants, all greedy with `synced_gpus=True` and the same
private generation config, interleaved round-robin (the machine is shared and noisy):

* ``raw``           `model.generate`, nothing else.
* ``local stop``    plus the engine's `SyncedStop` (reads a threading.Event each step).
* ``all_reduce stop`` plus a criterion that all-reduces the stop flag every step: the
                    collective-safe-looking alternative the engine rejects (it is only
                    correct when every rank generates the same number of tokens, as here).
* ``engine``        `engine.generate`: worker thread, progress hook, streamer on rank 0, `SyncedStop`.

tokens/s = generated tokens / wall seconds of the call (prefill included), as rank 0 sees it,
median and best of the runs; and rank 0's CPU time per token (all its threads), which a
shared, busy machine disturbs far less than wall time. Also printed: one scalar all_reduce.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import platformdirs
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from shardbook.rankd.generation.engine import (
    GenerationRequest,
    SyncedStop,
    build_generation_config,
    build_prompt_ids,
    generate,
)

PROMPTS = {
    "tiny": "What is the capital of France?",
    "smollm2": "Write a long story about a dragon who learns to fly.",
}


class AllReduceStop(StoppingCriteria):
    """Stop when any rank's event is set, decided by an all_reduce(MAX) every step."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        flag = torch.tensor([1.0 if self.event.is_set() else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return torch.full((input_ids.shape[0],), bool(flag.item()), dtype=torch.bool)


def model_path(name: str) -> Path:
    if name == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny import make_tiny_llama

        return make_tiny_llama(Path(tempfile.mkdtemp(prefix="bench-engine-")) / "tiny")
    if name == "smollm2":
        path = Path(platformdirs.user_cache_dir("shardbook")) / "models" / "smollm2-135m-instruct"
        if not (path / "config.json").exists():
            raise SystemExit(f"the demo model is not at {path}; build it first")
        return path
    return Path(name)


def load_sharded(path: Path, reshard_after_forward: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model.eval()


def variants(model: Any, tokenizer: Any, request: GenerationRequest) -> dict[str, Callable[[], int]]:
    """Each variant runs one generation and returns the number of tokens it generated."""
    prompt = build_prompt_ids(tokenizer, request.messages)
    config = build_generation_config(model, tokenizer, request, request.max_new_tokens)

    def raw(*criteria: StoppingCriteria) -> int:
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                generation_config=config,
                synced_gpus=True,
                stopping_criteria=StoppingCriteriaList(criteria),
            )
        return out.sequences.shape[1] - prompt.shape[1]

    def engine() -> int:
        on_text = (lambda text: None) if dist.get_rank() == 0 else None
        result = generate(model, tokenizer, request, device="cpu", on_text=on_text, stop_event=threading.Event())
        return result.generated_tokens

    return {
        "raw": raw,
        "local stop": lambda: raw(SyncedStop(threading.Event(), prompt_tokens=0, max_new_tokens=1 << 30, eos_ids=[])),
        "all_reduce stop": lambda: raw(AllReduceStop(threading.Event())),
        "engine": engine,
    }


def measure(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, dict[str, float]]:
    """Per variant: median and best tokens/s, median CPU ms per token (all threads of this rank), tokens.

    Runs are interleaved in a rotating order. CPU time leaves out the time spent waiting for a
    descheduled peer, so it shows the engine's own cost even on a busy machine.
    """
    rates: dict[str, list[float]] = {name: [] for name in runs}
    cpu_ms: dict[str, list[float]] = {name: [] for name in runs}
    counts: dict[str, int] = {}
    names = list(runs)
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            counts[name] = runs[name]()
            rates[name].append(counts[name] / (time.perf_counter() - start))
            cpu_ms[name].append(1e3 * (time.process_time() - cpu_start) / counts[name])
    return {
        name: {
            "median": statistics.median(rates[name]),
            "best": max(rates[name]),
            "cpu_ms": statistics.median(cpu_ms[name]),
            "tokens": counts[name],
        }
        for name in names
    }


def all_reduce_cost_us(num_ops: int = 500) -> float:
    flag = torch.zeros(1)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(num_ops):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return (time.perf_counter() - start) / num_ops * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2, or a checkpoint directory")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run (reshard_after_forward=False)")
    parser.add_argument("--tokens-resharded", type=int, default=16, help="new tokens per run when resharding")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--repeats-resharded", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    path = model_path(args.model)  # before the process group: save_pretrained writes weights on rank 0 only
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(path)
    question = PROMPTS.get(args.model, PROMPTS["tiny"])
    if rank == 0:
        print(f"model {path}, {dist.get_world_size()} ranks, gloo, 1 thread each, prompt {question!r}")
        print(f"one scalar all_reduce: {all_reduce_cost_us():.0f} us")
    else:
        all_reduce_cost_us()
    for reshard in (False, True):
        tokens = args.tokens_resharded if reshard else args.tokens
        repeats = args.repeats_resharded if reshard else args.repeats
        request = GenerationRequest(messages=[{"role": "user", "content": question}], max_new_tokens=tokens, seed=0)
        model = load_sharded(path, reshard)
        runs = variants(model, tokenizer, request)
        runs["raw"]()  # warm-up
        results = measure(runs, repeats)
        if rank == 0:
            print(f"\nreshard_after_forward={reshard}, {tokens} new tokens, {repeats} runs each")
            print("| variant | median tok/s | best tok/s | CPU ms/token (median) | vs raw | tokens |")
            print("|---|---|---|---|---|---|")
            raw_cpu = results["raw"]["cpu_ms"]
            for name, r in results.items():
                print(
                    f"| {name} | {r['median']:.1f} | {r['best']:.1f} | {r['cpu_ms']:.2f} "
                    f"| {r['cpu_ms'] - raw_cpu:+.2f} | {r['tokens']} |"
                )
        del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
