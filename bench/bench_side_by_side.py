"""Issue 32's side-by-side benchmark, run by ``bench_serve.py --batching --side-by-side``: shardbook against
``vllm serve`` (vLLM's CPU build, the anchor) and ``transformers serve --continuous-batching``, one server at a time.

Each server serves the demo model in ``--dtype`` (default: what the demo's ``dtype: fastest`` picks on this machine,
bfloat16 on a CPU with AMX or AVX512-BF16, else float32; given explicitly so that every server computes alike), started,
measured and stopped before the next one starts:

* vLLM: ``python -m vllm.entrypoints.openai.api_server`` from ``--vllm-python`` (or ``$VLLM_PYTHON``), its own venv
  (``bench/anchors/vllm-requirements.txt`` says how to make it), its defaults but ``--dtype`` and
  ``--gpu-memory-utilization 0.25`` (``vllm_serve`` says why). Without
  that python the vLLM column is skipped with a line saying so;
* ``transformers serve --continuous-batching``, one process, 2 threads (``bench_batching.transformers_serve``);
* shardbook: ``shardbook serve --nproc 2`` with ``--parallel.decode tp --model.dtype``, the config's
  defaults otherwise.

The same client for all (``bench_batching.stream``): streamed greedy chat completions, ``ignore_eos`` where the
server takes it (not ``transformers serve``: its replies may end early, tokens are then its chunks), measured
from the client's side:

* 1, 8, 32, 64 clients (``--counts``) x ``--client-tokens`` tokens, all sent at once: aggregate tok/s (generated
  tokens / (last token - first send)), TTFT p50 and requests refused (429) or failed;
* a long prompt (``--long-tokens`` of text, ~8k with the template) sent while 7 other streams decode (after
  their first tokens and 5 s more): its TTFT, and the 7 streams' inter-token gaps while it prefills (median and
  longest) against their median gap in those 5 s;
* a ``--turns`` conversation (the whole history resent each turn, 64 tokens a reply): TTFT of the last turn
  against the first.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bench_batching import MODEL, MODEL_DIR, OFFLINE, PROMPT, launched, pct, stream, together, tok_s, transformers_serve
from bench_prefix_reuse import QUESTIONS

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/smollm2-135m.yaml"
BASELINE_S = 5
VLLM_MEMORY = 0.25
LONG_TEXT = "The history of Paris spans two thousand years, from a Gallic settlement on an island in the Seine to a city of bridges, museums and boulevards. "  # noqa: E501


@contextlib.contextmanager
def vllm_serve(python: str, dtype: str) -> Iterator[str]:
    """vLLM's OpenAI server from its CPU build, its defaults but the dtype and its memory; yields its URL.

    Its default reserves 92% of the host's memory (``--gpu-memory-utilization``, on a CPU the share of RAM
    for weights and KV cache) and refuses to start when less is free, as on a machine shared with other work:
    25% of this 23 GiB host holds ~120k float32 tokens of the demo model's cache, more than 64 clients use.
    """
    port = 8710
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR)]
    argv += ["--served-model-name", MODEL, "--port", str(port), "--dtype", dtype]
    argv += ["--gpu-memory-utilization", str(VLLM_MEMORY)]
    with launched("vllm serve", argv, port, OFFLINE, wait_s=900) as url:
        yield url


@contextlib.contextmanager
def shardbook_serve(dtype: str, extra: list[str]) -> Iterator[str]:
    """``shardbook serve`` on 2 ranks of 1 thread under ``tp`` in ``dtype``, with ``extra`` flags, the demo config's
    defaults otherwise."""
    port = 8720
    argv = [str(Path(sys.executable).parent / "shardbook"), "serve", "--nproc", "2", "--port", str(port), CONFIG]
    argv += ["--parallel.decode", "tp", "--model.dtype", dtype, *extra]
    with launched("shardbook serve", argv, port, {**OFFLINE, "OMP_NUM_THREADS": "1"}, wait_s=900) as url:
        yield url


def server(name: str, vllm_python: str, dtype: str, shardbook_flags: list[str]):
    """The server's context manager, the model name its requests give, and whether it takes ``ignore_eos``."""
    if name == "vllm":
        return vllm_serve(vllm_python, dtype), MODEL, True
    if name == "transformers":
        return transformers_serve(True, dtype), str(MODEL_DIR), False
    return shardbook_serve(dtype, shardbook_flags), MODEL, True


def served_dtype(asked: str) -> str:
    """``asked``, or for ``fastest`` the dtype shardbook's ``model.dtype: fastest`` picks on this machine's CPU."""
    if asked != "fastest":
        return asked
    import torch

    from shardbook.rankd.parallel.fastest_dtype import fastest_dtype

    return str(fastest_dtype(torch.device("cpu"))).removeprefix("torch.")


def chat(url: str, model: str, eos: bool, messages: list[dict], n: int, until=None, started=None) -> dict:
    """One streamed greedy chat completion; tokens from ``usage`` where the server gives it, else chunks."""
    body = {"model": model, "messages": messages, "max_tokens": n, "temperature": 0}
    if eos:
        body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    result = stream(url, "/v1/chat/completions", body, "content", until, started)
    usage = result.get("usage") or {}
    return {
        **result,
        "tokens": usage.get("completion_tokens", len(result["arrivals"])),
        "prompt": usage.get("prompt_tokens"),
    }


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": PROMPT.format(i=i)}]


def clients(url: str, model: str, eos: bool, num: int, n: int) -> dict:
    """``num`` clients at once: aggregate tok/s and TTFT p50 of the served, how many were refused or failed."""
    results = together(lambda i: chat(url, model, eos, ask(i), n), num, refused_ok=True)
    served = [r for r in results if r is not None and r["arrivals"]]
    refused = sum(1 for r in results if r is not None and r["status"] == 429)
    ttft = [r["arrivals"][0] - r["sent"] for r in served]
    return {
        "tok_s": tok_s(served) if served else 0.0,
        "ttft_p50": pct(ttft, 0.5) if ttft else float("nan"),
        "refused": refused,
        "failed": num - len(served) - refused,
    }


def long_text(tokens: int) -> str:
    """About ``tokens`` tokens of text (the model's tokenizer), then a question about it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    ids = tokenizer(LONG_TEXT * (tokens // 20 + 1))["input_ids"][:tokens]
    return tokenizer.decode(ids) + "\n\nSummarise the text above in one sentence."


def long_prompt(url: str, model: str, eos: bool, text: str, others: int = 7) -> dict:
    """The long prompt's TTFT while ``others`` streams decode, and their gaps while it prefilled."""
    stop, started = threading.Event(), threading.Semaphore(0)
    running: list[dict | None] = [None] * others
    threads = [
        threading.Thread(target=lambda i=i: running.__setitem__(i, chat(url, model, eos, ask(i), 4096, stop, started)))
        for i in range(others)
    ]
    for t in threads:
        t.start()
    for _ in range(others):
        if not started.acquire(timeout=600):
            stop.set()
            raise RuntimeError(f"the {others} other streams did not all start within 600 s: {running}")
    time.sleep(BASELINE_S)  # their gaps before the long prompt
    long = chat(url, model, eos, [{"role": "user", "content": text}], 8)
    stop.set()
    for t in threads:
        t.join(900)
    if not long["arrivals"]:
        return {"error": f"{long['status']}: {long['text'][:200]}"}
    sent, first = long["sent"], long["arrivals"][0]
    during, before = [], []
    for r in filter(None, running):
        gaps = list(zip(r["arrivals"], r["arrivals"][1:]))
        during += [b - a for a, b in gaps if b > sent and a < first]
        before += [b - a for a, b in gaps if b <= sent]
    return {
        "ttft": first - sent,
        "prompt": long["prompt"],
        "gap_before_p50": statistics.median(before) if before else float("nan"),
        "gap_p50": statistics.median(during) if during else float("nan"),
        "gap_max": max(during) if during else float("nan"),
    }


def conversation(url: str, model: str, eos: bool, turns: int, n: int) -> dict:
    """TTFT of each turn of one conversation, its whole history resent each turn."""
    messages, ttft = [], []
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        reply = chat(url, model, eos, messages, n)
        ttft.append(reply["arrivals"][0] - reply["sent"])
        messages.append({"role": "assistant", "content": reply["text"]})
    return {"first": ttft[0], "last": ttft[-1], "ratio": ttft[-1] / ttft[0]}


def measure(url: str, model: str, eos: bool, args, text: str) -> dict:
    chat(url, model, eos, ask(0), 4)  # warm-up
    found = {num: clients(url, model, eos, num, args.client_tokens) for num in args.counts}
    if args.long_tokens:
        found["long"] = long_prompt(url, model, eos, text)
    if args.turns:
        found["turns"] = conversation(url, model, eos, args.turns, 64)
    return found


def run(args) -> int:
    """Each server in turn (started, measured, stopped), then the table."""
    vllm_python = args.vllm_python or os.environ.get("VLLM_PYTHON")
    text = long_text(args.long_tokens)
    args.dtype = served_dtype(args.dtype)
    found: dict = {}
    for name in args.servers:
        if name == "vllm" and not (vllm_python and Path(vllm_python).exists()):
            found[name] = {"error": f"skipped: no vLLM python (--vllm-python or $VLLM_PYTHON: {vllm_python!r})"}
            print(f"vllm: {found[name]['error']}; bench/anchors/vllm-requirements.txt says how to install it")
            continue
        context, model, eos = server(name, vllm_python, args.dtype, shlex.split(args.shardbook_flags))
        try:
            with context as url:
                found[name] = measure(url, model, eos, args, text)
        except Exception as e:  # one server's failure is reported in its column; the others still run
            found[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{name}: {found[name]}", flush=True)
    return report(found, args)


def report(found: dict, args) -> int:
    print(f"{MODEL}, {args.dtype}, one server at a time; streamed greedy chat completions, {args.client_tokens} tokens")
    print("| | " + " | ".join(args.servers) + " |\n|---|" + "---|" * len(args.servers))
    rows = [(f"{num} clients", lambda r, num=num: _clients_cell(r[num])) for num in args.counts]
    if args.long_tokens:  # 0: not measured
        rows.append(("long prompt: TTFT", lambda r: _long_cell(r["long"])))
    if args.turns:
        rows.append((f"{args.turns}-turn conversation: TTFT first -> last", lambda r: _turns_cell(r["turns"])))
    for label, cell in rows:
        cells = [found[s]["error"] if "error" in found[s] else cell(found[s]) for s in args.servers]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0 if all("error" not in found[s] for s in args.servers) else 1


def _clients_cell(r: dict) -> str:
    cell = f"{r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50']:.2f} s"
    return (
        cell
        + (f", {r['refused']} refused" if r["refused"] else "")
        + (f", {r['failed']} failed" if r["failed"] else "")
    )


def _long_cell(r: dict) -> str:
    if "error" in r:
        return f"failed: {r['error']}"
    return (
        f"{r['ttft']:.1f} s ({r['prompt'] or '?'} prompt tokens); 7 streams' gaps during it p50 {r['gap_p50']:.2f} s, "
        f"max {r['gap_max']:.2f} s (before: p50 {r['gap_before_p50']:.2f} s)"
    )


def _turns_cell(r: dict) -> str:
    return f"{r['first']:.2f} s -> {r['last']:.2f} s ({r['ratio']:.2f}x)"
