"""``gpu_check.py``'s servers and clients: ``shardbook serve`` and vLLM's API server started and stopped as process
groups, and streamed chat completions sent to them (one reply as ``%%chat`` sends it, or N clients at once).

Both servers get the same requests: ``/v1/chat/completions``, ``stream``, ``temperature 0``, ``ignore_eos`` and
``stream_options.include_usage``, so every reply has exactly ``max_tokens`` tokens (counted from ``usage``) and
each content chunk's arrival is timed with ``time.perf_counter``. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
URL = re.compile(r"at (http://\S+/v1)")
SYSTEM = "you are a helpful assistant answer briefly"
QUESTION = "tell me about the city of paris"
PACKAGES = {"kernel": "kernel", "magics": "magics", "rankd": "rankd", "configs": "configs"}
"""shardbook's subpackages and their folders in the checkout (pyproject's package-dir)."""


def shardbook_env(tmp: Path) -> dict[str, str]:
    """The environment for every stage's processes: where shardbook is not installed (a lent machine's image),
    a ``shardbook`` package of links into this checkout goes first on ``PYTHONPATH``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    probe = subprocess.run([sys.executable, "-c", "import shardbook.rankd"], env=env, capture_output=True)
    if probe.returncode == 0:
        return env
    package = tmp / "site" / "shardbook"
    package.mkdir(parents=True)
    for name in ("__init__.py", "__main__.py"):
        (package / name).symlink_to(REPO / "shardbook" / name)
    for name, folder in PACKAGES.items():
        (package / name).symlink_to(REPO / folder)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package.parent), env.get("PYTHONPATH")]))
    return env


class ServerProcess:
    """A server in its own process group: started, waited on until it serves, stopped with SIGTERM then SIGKILL."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], model: str, url: str | None = None):
        self.name, self.argv, self.env, self.model, self.url = name, argv, env, model, url
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.ready_s = float("nan")

    @classmethod
    def shardbook(cls, model: Path, plan: dict, env: dict[str, str]) -> ServerProcess:
        most = str(max(plan["clients"]))
        argv = [sys.executable, "-m", "shardbook", "serve", str(model), "--port", "0", "--max-waiting", most]
        argv += ["--model.dtype", plan["dtype"], "--parallel.device", plan["device"]]
        argv += ["--inference.max_batch_sequences", most]
        return cls("shardbook", argv, env, model.name)

    @classmethod
    def vllm(cls, python: str, model: Path, plan: dict, env: dict[str, str]) -> ServerProcess:
        """vLLM's OpenAI server on `model` with its defaults, given only the model, its name, the port and dtype."""
        port = free_port()
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", plan["dtype"]]
        argv += ["--served-model-name", model.name, "--host", "127.0.0.1", "--port", str(port)]
        return cls("vllm", argv, env, model.name, url=f"http://127.0.0.1:{port}/v1")

    def start(self, deadline: float) -> None:
        started = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        while not self._serving():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} was not serving within the stage's time: {self.tail()}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - started

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def _serving(self) -> bool:
        if self.url is None:
            found = URL.search(self.log())
            self.url = found.group(1) if found else None
            return self.url is not None
        try:
            status, _ = request(self.url, "GET", "/models", None, timeout=5)
        except OSError:
            return False
        return status == 200

    def log(self) -> str:
        return "".join(self.lines)

    def tail(self, lines: int = 3) -> str:
        kept = [line.strip() for line in self.lines if line.strip()]
        return " / ".join(kept[-lines:])[-400:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(
            method, parts.path + path, json.dumps(body) if body else None, {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def stream_chat(url: str, model: str, messages: list[dict], tokens: int, timeout: float) -> dict:
    """One streamed greedy chat completion of exactly `tokens` tokens: its status, send time, chunk arrivals, tokens."""
    parts = urlparse(url)
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    body.update({"stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=max(timeout, 1))
    sent = time.perf_counter()
    try:
        conn.request("POST", parts.path + "/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return {"status": response.status, "error": response.read()[:200].decode(errors="replace")}
        arrivals, usage = [], None
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
            usage = chunk.get("usage") or usage
        n = usage["completion_tokens"] if usage else len(arrivals)
        return {"status": 200, "sent": sent, "arrivals": arrivals, "tokens": n}
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"status": None, "error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()


def chat_replies(url: str, model: str, tokens: int, deadline: float, rounds: int = 3) -> dict:
    """A reply as ``%%chat`` sends one (the system prompt, then the question), `rounds` times after a warm-up:
    TTFT and tok/s after the first token, medians."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    stream_chat(url, model, messages, 4, deadline - time.monotonic())  # warm-up
    replies = [stream_chat(url, model, messages, tokens, deadline - time.monotonic()) for _ in range(rounds)]
    bad = [r for r in replies if r["status"] != 200 or not r["arrivals"]]
    if bad:
        return {"status": "failed", "result": f"{len(bad)}/{rounds} replies failed: {bad[0].get('error', 'no text')}"}
    ttft = statistics.median(r["arrivals"][0] - r["sent"] for r in replies)
    rates = [(r["tokens"] - 1) / (r["arrivals"][-1] - r["arrivals"][0]) for r in replies if len(r["arrivals"]) > 1]
    rate = f"{statistics.median(rates):.1f} tok/s" if rates else "one chunk"
    return {"status": "ok", "result": f"TTFT {1000 * ttft:.0f} ms, {rate}, {tokens} tokens, median of {rounds}"}


def burst(url: str, model: str, num: int, tokens: int, deadline: float) -> dict:
    """`num` clients sent at once (a barrier releases them together), each a streamed reply of `tokens`."""
    results: list[dict | None] = [None] * num
    gate = threading.Barrier(num)

    def client(i: int) -> None:
        messages = [{"role": "user", "content": f"{QUESTION} client w{i}"}]
        gate.wait()
        results[i] = stream_chat(url, model, messages, tokens, deadline - time.monotonic())

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(num)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 5)
    served = [r for r in results if r and r["status"] == 200 and r["arrivals"]]
    refused = [r for r in results if r and r["status"] not in (200, None)]
    failed = num - len(served) - len(refused)
    if not served:
        first = next((r for r in results if r), {"error": "no reply in time"})
        return {"status": "failed", "result": f"0/{num} served: {first.get('status')} {first.get('error', '')}"}
    span = max(r["arrivals"][-1] for r in served) - min(r["sent"] for r in served)
    ttft = sorted(r["arrivals"][0] - r["sent"] for r in served)
    result = (
        f"{sum(r['tokens'] for r in served) / span:.1f} tok/s, TTFT p50 {1000 * statistics.median(ttft):.0f} ms, "
        f"max {1000 * ttft[-1]:.0f} ms; {len(served)}/{num} served"
    )
    if refused:
        result += f", {len(refused)} refused ({refused[0]['status']}: {refused[0]['error'][:80]})"
    if failed:
        errors = [r.get("error", "") for r in results if r and r["status"] is None]
        result += f", {failed} failed ({errors[0][:80] if errors else 'no reply in time'})"
    return {"status": "ok" if len(served) == num else "failed", "result": result}
