"""``gpu_check.py``'s capture stage: can the continuous batch's decode step be ``torch.compile``d, and captured in a
CUDA graph?

Run in its own process, so the parent bounds it with a timeout and keeps what it printed before a hang. It loads
the checkpoint with transformers on one device, prefills ``--rows`` prompts into a ``BatchState`` with
``execute_step`` (what every rank runs for a step of the batch), then prints one JSON line per check as soon as
it is known:

* ``eager``: ms per decode step (the median of ``--steps``);
* ``cuda graph``: one decode ``execute_step`` captured with ``torch.cuda.graph`` and replayed; its logits against
  an eager step from the same state, and the replay's ms;
* ``compile``: ``model.forward`` replaced by ``torch.compile(model.forward, backend=...)``; seconds of the first
  steps (compilation and the recompile once the cache length changes), ms per step after, dynamo's graphs and
  graph breaks (the commonest reason), the logits against eager from the same state;
* ``compile + cuda graphs``: the same with ``mode="reduce-overhead"`` (inductor's CUDA graph trees), and whether
  inductor used CUDA graphs or skipped them (its perf hint's reason), CUDA only.

    python bench/gpu_capture.py MODEL_DIR --device cuda --dtype bfloat16
    python bench/gpu_capture.py MODEL_DIR --device cpu --dtype float32 --backend eager --rows 2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections import Counter

import torch

PROMPT = "tell me about the city of paris client w{i}"
os.environ["SHARDBOOK_PAGED_CACHE"] = "0"  # the cache a GPU's batch has (paging is a CPU kernel's), on a CPU too


def report(check: str, status: str, result: str, **figures) -> None:
    print(json.dumps({"check": check, "status": status, "result": result, **figures}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=8, help="sequences decoded together")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per check")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend (eager: dynamo's capture alone)")
    p.add_argument("--dynamic", action="store_true", help="compile for any cache length at once (one compile)")
    p.add_argument("--warm", type=int, default=4, help="compiled steps before the timed ones (compile, recompile)")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with torch.no_grad():
        decoder = Decoder(model, tokenizer, device, args.rows)
        eager_ms = decoder.timed(args.steps)
        report("eager", "ok", f"{eager_ms:.2f} ms/step, {args.rows} rows", ms=eager_ms)
        if device.type == "cuda":
            check_cuda_graph(decoder, eager_ms)
        else:
            report("cuda graph", "skipped", f"no CUDA device ({device.type})")
        check_compile(decoder, args, eager_ms, mode=None)
        if device.type == "cuda":
            check_compile(decoder, args, eager_ms, mode="reduce-overhead")
        else:
            report("compile + cuda graphs", "skipped", f"no CUDA device ({device.type})")
    return 0


class Decoder:
    """A batch of `rows` prefilled sequences and their next tokens, decoded step by step as a rank does."""

    def __init__(self, model, tokenizer, device: torch.device, rows: int):
        from shardbook.rankd.generation.batch_steps import BatchState, StepPlan

        self.model, self.device = model, device
        self.eager_forward = model.forward
        self.state = BatchState(model, device)
        prompts = [tokenizer(PROMPT.format(i=i))["input_ids"] for i in range(rows)]
        outcome = self.run(StepPlan(leave=[], decode=[], join=[(ids, False) for ids in prompts]))
        self.tokens = [int(logits[-1].argmax()) for logits in outcome.joined]

    def run(self, plan):
        from shardbook.rankd.generation.batch_steps import execute_step

        outcome = execute_step(self.state, plan)
        if outcome.failure:
            raise StepError(outcome.error_text())
        return outcome

    def step(self) -> torch.Tensor:
        """One decode step of every row; its logits. The rows go on with their greedy tokens."""
        from shardbook.rankd.generation.batch_steps import StepPlan

        logits = self.run(StepPlan(leave=[], decode=self.tokens, join=[])).decoded
        self.tokens = logits.argmax(-1).tolist()
        return logits

    def timed(self, steps: int) -> float:
        times = []
        for _ in range(steps):
            self.sync()
            start = time.perf_counter()
            self.step()
            self.sync()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def snapshot(self) -> tuple:
        s = self.state
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in s.cache.layers]
        return s.cache, s.mask.clone(), s.next_pos.clone(), layers, list(self.tokens)

    def restore(self, snap: tuple) -> None:
        cache, mask, next_pos, layers, tokens = snap
        self.state.cache, self.state.mask, self.state.next_pos, self.tokens = cache, mask.clone(), next_pos, tokens
        for layer, (keys, values) in zip(cache.layers, layers):
            layer.keys, layer.values = keys.clone(), values.clone()

    def eager_reference(self) -> tuple[tuple, torch.Tensor]:
        """The state now, and the logits an eager step gives from it (the state is put back)."""
        snap = self.snapshot()
        compiled, self.model.forward = self.model.forward, self.eager_forward
        try:
            reference = self.step()
        finally:
            self.model.forward = compiled
            self.restore(snap)
        return snap, reference


class StepError(RuntimeError):
    """A batch step failed: the error text every rank agreed on."""


def compare(logits: torch.Tensor, reference: torch.Tensor) -> str:
    diff = (logits.float() - reference.float()).abs().max().item()
    same = int((logits.argmax(-1) == reference.argmax(-1)).sum())
    return f"logits max diff {diff:.3g} from eager, next tokens equal {same}/{len(reference)}"


def check_cuda_graph(decoder: Decoder, eager_ms: float) -> None:
    from shardbook.rankd.generation.batch_steps import StepPlan, execute_step

    snap, reference = decoder.eager_reference()
    graph, outcome = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph):
            outcome = execute_step(decoder.state, StepPlan(leave=[], decode=decoder.tokens, join=[]))
    except Exception as e:
        inner = outcome.error_text() if outcome is not None and outcome.failure else None
        decoder.restore(snap)
        report("cuda graph", "failed", f"capture: {inner or first_line(e)}")
        return
    if outcome.failure:
        decoder.restore(snap)
        report("cuda graph", "failed", f"capture: {outcome.error_text()}")
        return
    decoder.sync()
    start = time.perf_counter()
    graph.replay()
    decoder.sync()
    replay_ms = 1000 * (time.perf_counter() - start)
    text = compare(outcome.decoded, reference)
    decoder.restore(snap)
    report("cuda graph", "ok", f"captured; replay {replay_ms:.2f} ms against eager {eager_ms:.2f}; {text}")


class PerfHints(logging.Handler):
    """Inductor's perf hints (why it skipped CUDA graphs), kept."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_compile(decoder: Decoder, args, eager_ms: float, mode: str | None) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    name = "compile" if mode is None else "compile + cuda graphs"
    torch._dynamo.reset()
    counters.clear()
    hints = PerfHints()
    if mode == "reduce-overhead":
        torch._logging.set_logs(perf_hints=True)
        logging.getLogger("torch._inductor").addHandler(hints)
    dynamic = True if args.dynamic else None  # None: torch's default, a recompile once the cache length changes
    how = f"{args.backend}{f' {mode}' if mode else ''}{', dynamic' if args.dynamic else ''}"
    decoder.model.forward = torch.compile(decoder.eager_forward, backend=args.backend, mode=mode, dynamic=dynamic)
    try:
        start = time.perf_counter()
        for _ in range(args.warm):
            decoder.step()
        decoder.sync()
        compile_s = time.perf_counter() - start
        _, reference = decoder.eager_reference()
        text = compare(decoder.step(), reference)
        ms = decoder.timed(args.steps)
    except Exception as e:
        report(name, "failed", f"{how}: {first_line(e)}")
        return
    finally:
        decoder.model.forward = decoder.eager_forward
    breaks = counters["graph_break"]
    common = f" (commonest: {Counter(breaks).most_common(1)[0][0][:100]})" if breaks else ""
    result = (
        f"{how}: first {args.warm} steps {compile_s:.1f} s, then {ms:.2f} ms/step against eager {eager_ms:.2f}; "
        f"{counters['stats']['unique_graphs']} graphs, {sum(breaks.values())} graph breaks"
        f"{common}; {text}"
    )
    if mode == "reduce-overhead":
        hinted = [m for m in hints.messages if "skipping cudagraphs" in m]
        skips = counters["inductor"]["cudagraph_skips"]
        if hinted:
            result += f"; CUDA graphs skipped: {hinted[0][:160]}"
        else:
            result += f"; CUDA graphs skipped {skips} times" if skips else "; CUDA graphs used (no skip counted)"
    report(name, "ok", result, ms=ms, compile_s=compile_s)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


if __name__ == "__main__":
    sys.exit(main())
