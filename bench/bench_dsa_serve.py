"""GLM-5's architecture served: aggregate tok/s of 8 streamed clients at once against 1 client alone, through
``shardbook serve`` on 2 ranks under ``tp`` (issue 32's "a tiny random glm_moe_dsa: 8 clients at least 3x one
client's tok/s", measured where the issue asks for it: the server, not one process).

The random ``glm_moe_dsa`` of ``bench_dsa_batch.py`` (25.7M parameters; drawn in-process, nothing fetched) is
written to a temporary directory and served with ``shardbook serve DIR --nproc 2 --parallel.decode tp``, float32,
one thread per rank. Each client streams ``/v1/completions`` (greedy, ``ignore_eos``, ``--tokens`` tokens). One
client alone ``--repeats`` times, then ``--repeats`` bursts of ``--clients`` at once; tok/s = tokens over the span
from the first send to the last chunk, the medians.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_dsa_serve.py
    .venv/bin/python bench/bench_dsa_serve.py --clients 4 --tokens 16 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.tiny: the tokenizer and model writer the tests use
sys.path.insert(0, str(ROOT / "bench"))

from bench_batching import OFFLINE, stream, together, tok_s  # noqa: E402
from gpu_serving import ServerProcess, free_port  # noqa: E402


def client(url: str, model: str, i: int, n: int) -> dict:
    body = {"model": model, "prompt": f"Request {i}: tell me a story.", "max_tokens": n, "temperature": 0}
    return {**stream(url, "/v1/completions", {**body, "ignore_eos": True}, "text"), "tokens": n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from bench_dsa_batch import GLM5_SHAPE

    from tests.tiny import make_tiny_lm

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_lm(Path(tmp) / "glm5", family="glm_moe_dsa", max_position_embeddings=4096, **GLM5_SHAPE)
        port = free_port()
        launcher = str(Path(sys.executable).parent / "shardbook")
        argv = [launcher, "serve", "--nproc", "2", "--port", str(port), str(path)]
        argv += ["--parallel.decode", "tp", "--model.dtype", "float32"]
        env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
        server = ServerProcess("shardbook serve", argv, env, path.name, url=f"http://127.0.0.1:{port}/v1")
        try:
            server.start(time.monotonic() + 600)
            url = server.url.removesuffix("/v1")
            client(url, path.name, 0, 4)  # warm-up
            alone = [tok_s([client(url, path.name, 0, args.tokens)]) for _ in range(args.repeats)]
            many = [
                tok_s(together(lambda i: client(url, path.name, i, args.tokens), args.clients))
                for _ in range(args.repeats)
            ]
        finally:
            server.stop()
    one, all_at_once = statistics.median(alone), statistics.median(many)
    print(
        f"glm_moe_dsa 25.7M, shardbook serve, 2 ranks tp, float32, {args.tokens} tokens a client; "
        f"1 client {one:.1f} tok/s ({', '.join(f'{x:.1f}' for x in alone)}), "
        f"{args.clients} at once {all_at_once:.1f} tok/s ({', '.join(f'{x:.1f}' for x in many)}): "
        f"{all_at_once / one:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
