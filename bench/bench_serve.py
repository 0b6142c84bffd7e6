"""Serving benchmark (issue 13): a streamed request through ``%serve`` against ``%%chat``, then 8 clients at once.

One 2-rank shardbook kernel (``bench_chat.Kernel``: jupyter_client, IOPub read as a frontend
does) loads the demo model and starts ``%serve --port 0``. Both paths are timed from the
client's side with ``time.perf_counter``:

* ``chat``  ``%%chat --new --output text --max-new-tokens N`` (greedy, the config's system prompt):
            first token = first stdout message holding reply text, from the execute_request's send.
* ``http``  ``POST /v1/chat/completions`` with ``stream: true`` and the same messages, read as
            server-sent events over a raw connection: first token = first chunk with content,
            from the request's send.

tok/s = (generated tokens - 1) / (last text arrival - first text arrival), the tokens from the
status line (chat) or ``usage`` (http); rounds alternate which path goes first and the texts must
be equal. Then 8 clients send streamed requests 50 ms apart; all must complete, start in the
order they were sent (first chunks in send order), and each reports its wait in the queue
(``X-Shardbook-Queue-Wait-Ms``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_serve.py              # 5 rounds of 64 tokens, ~4 min
    .venv/bin/python bench/bench_serve.py --rounds 2 --tokens 16 --clients 4

``--batching`` measures continuous batching instead (issue 18; ``bench_batching.py`` says what): 8 and 32
streamed clients under gather and tp, guidellm at 1 and 8 streams, and ``transformers serve`` as the anchor.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_serve.py --batching --clients 8 --many 32 --client-tokens 32
    .venv/bin/python bench/bench_serve.py --batching --clients 2 --many 4 --client-tokens 4 --guidellm-requests 2

``--batching --side-by-side`` is issue 32's comparison instead (``bench_side_by_side.py`` says what): ``vllm serve``
(vLLM's CPU build, from ``--vllm-python``), ``transformers serve --continuous-batching`` and ``shardbook serve``
under ``tp``, one at a time: 1/8/32/64 clients, an 8k-token prompt beside 7 streams, a 10-turn conversation.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_serve.py --batching --side-by-side --client-tokens 64 \
        --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat import Kernel

CONFIG = "configs/smollm2-135m.yaml"
MODEL = "smollm2-135m-instruct"
QUESTION = "Tell me about the city of Paris."
SYSTEM = "You are a helpful assistant. Answer briefly."  # the config's system_prompt, which %%chat sends
STATUS = re.compile(r"\[(\d+) prompt tokens(?: \(\d+ cached\))?, (\d+) generated")


def run_chat(kernel: Kernel, n: int) -> dict:
    cell = kernel.ok(f"%%chat --new --output text --max-new-tokens {n}\n{QUESTION}")
    texts = [
        (m["received_at"], m["content"]["text"]) for m in cell.of_type("stream") if m["content"]["name"] == "stdout"
    ]
    live = [t for t, text in texts if text.strip() and not STATUS.search(text)]
    tokens = int(STATUS.search(cell.stdout()).group(2))
    return {"text": cell.stdout().rsplit("\n[", 1)[0], "tokens": tokens, **timing(cell.sent_at, live, tokens)}


def run_http(url: str, n: int) -> dict:
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    body = {
        "model": MODEL,
        "max_tokens": n,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    }
    sent = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    arrivals, text, usage = [], [], None
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if content:
            arrivals.append(time.perf_counter())
            text.append(content)
        usage = chunk.get("usage") or usage
    conn.close()
    tokens = usage["completion_tokens"]
    wait_ms = float(response.getheader("X-Shardbook-Queue-Wait-Ms"))
    return {"text": "".join(text), "tokens": tokens, "sent": sent, "wait_ms": wait_ms, **timing(sent, arrivals, tokens)}


def timing(sent: float, arrivals: list[float], tokens: int) -> dict:
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else float("nan")
    return {
        "first": arrivals[0],
        "end": arrivals[-1],
        "ttft_ms": (arrivals[0] - sent) * 1000,
        "tok_s": (tokens - 1) / span if span > 0 else float("nan"),
    }


def concurrent_clients(url: str, num: int, n: int) -> list[dict]:
    results: list[dict | None] = [None] * num

    def client(i: int) -> None:
        results[i] = run_http(url, n)

    threads = []
    for i in range(num):
        threads.append(threading.Thread(target=client, args=(i,)))
        threads[-1].start()
        time.sleep(0.05)  # a defined arrival order, not a wait for a result
    for t in threads:
        t.join(900)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--client-tokens", type=int, default=16)
    p.add_argument("--batching", action="store_true", help="measure continuous batching (bench_batching.py)")
    p.add_argument("--many", type=int, default=32, help="--batching: clients of the latency run")
    p.add_argument("--guidellm-requests", type=int, default=32, help="--batching: guidellm requests per stream count")
    p.add_argument("--side-by-side", action="store_true", help="--batching: issue 32's comparison with vLLM")
    p.add_argument("--vllm-python", help="--side-by-side: the python of vLLM's venv (else $VLLM_PYTHON)")
    p.add_argument("--counts", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 32, 64])
    long_help = "--side-by-side: the long prompt's text tokens (0: none)"
    p.add_argument("--long-tokens", type=int, default=7900, help=long_help)
    p.add_argument("--turns", type=int, default=10, help="--side-by-side: the conversation's turns (0: none)")
    p.add_argument("--servers", type=lambda s: s.split(","), default=["vllm", "transformers", "shardbook"])
    p.add_argument("--dtype", default="fastest", help="--side-by-side: every server's dtype (fastest: this CPU's)")
    p.add_argument("--shardbook-flags", default="", help="--side-by-side: more flags for shardbook serve")
    args = p.parse_args(argv)
    if args.batching and args.side_by_side:
        from bench_side_by_side import run

        return run(args)
    if args.batching:
        from bench_batching import run

        return run(args)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        kernel = Kernel(Path(tmp))
        try:
            kernel.ok(f"%load_sharded {CONFIG}")
            url = re.search(r"at (http://\S+/v1)", kernel.ok("%serve --port 0").stdout()).group(1)
            run_chat(kernel, 4), run_http(url, 4)  # warm-up: both paths once
            chat, served = [], []
            for r in range(args.rounds):
                for path in ("chat", "http") if r % 2 == 0 else ("http", "chat"):
                    (chat if path == "chat" else served).append(
                        run_chat(kernel, args.tokens) if path == "chat" else run_http(url, args.tokens)
                    )
            clients = concurrent_clients(url, args.clients, args.client_tokens)
        finally:
            kernel.stop()
    return report(chat, served, clients, args)


def report(chat: list[dict], served: list[dict], clients: list[dict | None], args) -> int:
    same = all(c["text"] == h["text"] for c, h in zip(chat, served))
    med = {
        name: {k: statistics.median(r[k] for r in rows) for k in ("ttft_ms", "tok_s")}
        for name, rows in (("chat", chat), ("http", served))
    }
    ratio, extra = med["http"]["tok_s"] / med["chat"]["tok_s"], med["http"]["ttft_ms"] - med["chat"]["ttft_ms"]
    print(f"{args.rounds} rounds, {args.tokens} tokens, {MODEL} on 2 ranks; texts equal: {same}")
    print(f"{'path':<8}{'first token ms':>16}{'tok/s':>8}")
    for name in ("chat", "http"):
        print(f"{name:<8}{med[name]['ttft_ms']:>16.1f}{med[name]['tok_s']:>8.2f}")
    print(f"http / chat tok/s {ratio:.3f} (target >= 0.95); http - chat first token {extra:+.1f} ms (target <= +30)")
    done = [c for c in clients if c is not None]
    order = sorted(range(len(done)), key=lambda i: done[i]["first"])
    fifo = order == list(range(len(done)))
    print(f"{len(done)}/{len(clients)} concurrent clients completed, in FIFO order: {fifo}")
    print(f"{'client':<8}{'queue wait ms':>14}{'first token ms':>16}{'tokens':>8}")
    for i, c in enumerate(done):
        print(f"{i:<8}{c['wait_ms']:>14.0f}{c['ttft_ms']:>16.0f}{c['tokens']:>8}")
    ok = same and ratio >= 0.95 and extra <= 30 and fifo and len(done) == len(clients)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
