"""Talking to a shardbook server in tests: raw HTTP for the error paths and streams cut short,
the official client otherwise."""

from __future__ import annotations

import http.client
import json
import re
import time
from dataclasses import dataclass
from urllib.parse import urlparse

URL = re.compile(r"at (http://\S+/v1)")


def server_url(text: str) -> str:
    match = URL.search(text)
    assert match, f"no server URL in {text!r}"
    return match.group(1)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: dict

    @property
    def error(self) -> dict:
        return self.body["error"]


def request(
    url: str, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None, timeout: float = 60
) -> Reply:
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return Reply(response.status, dict(response.getheaders()), json.loads(response.read() or b"{}"))
    finally:
        conn.close()


def chat(url: str, model: str, content: str, headers: dict | None = None, **fields) -> Reply:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **fields}
    return request(url, "POST", "/v1/chat/completions", body, headers)


class OpenStream:
    """A streamed completion read chunk by chunk over a connection the test can drop at any moment."""

    def __init__(self, url: str, model: str, content: str, **fields):
        parts = urlparse(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True, **fields}
        self.conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        self.response = None  # read on the first chunk: a request waiting in line has no response yet

    def next_chunk(self) -> dict | None:
        """The next event's JSON; None at ``data: [DONE]``."""
        if self.response is None:
            self.response = self.conn.getresponse()
            assert self.response.status == 200, self.response.read()
        while True:
            line = self.response.readline()
            assert line, "the stream ended without data: [DONE]"
            line = line.decode().strip()
            if line == "data: [DONE]":
                return None
            if line.startswith("data: "):
                return json.loads(line[len("data: ") :])

    def read_to_end(self) -> list[dict]:
        chunks = []
        while (chunk := self.next_chunk()) is not None:
            chunks.append(chunk)
        return chunks

    def drop(self) -> None:
        """Close the connection as a client that gives up does."""
        self.conn.sock.close()
        self.conn.close()


def joined_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def finish_reason(chunks: list[dict]) -> str | None:
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return reasons[-1] if reasons else None


def wait_for_health(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if request(url, "GET", "/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer /health within {timeout} s")


def assert_demo_model_replies(url: str, api_key: str = "unused") -> None:
    """What the issue asks of the demo model through the official client, on any shardbook server at ``url``:
    "Paris", streamed deltas equal to the whole reply (greedy), usage equal to the tokenizer's counts,
    a reproducible seed, and stop strings cut exactly (whole and streamed)."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    from shardbook.kernel.api.configs import resolve_config
    from shardbook.kernel.api.fetch import resolve_model_path
    from shardbook.rankd.config.parsing import load_config
    from shardbook.rankd.generation.engine import build_prompt_ids

    client, model = OpenAI(base_url=url, api_key=api_key), "smollm2-135m-instruct"
    question = [{"role": "user", "content": "What is the capital of France?"}]

    def ask(**fields):
        return client.chat.completions.create(model=model, messages=question, max_tokens=32, **fields)

    whole = ask()
    text = whole.choices[0].message.content
    assert "Paris" in text
    assert joined_text([c.model_dump() for c in ask(stream=True)]) == text
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    served_config = load_config(resolve_config("demo").path)  # its system prompt applies to HTTP requests too
    system = served_config.inference.system_prompt
    prompt_ids = build_prompt_ids(tokenizer, [{"role": "system", "content": system}, *question])
    ended = whole.choices[0].finish_reason == "stop"  # the end-of-text token counts as generated
    assert whole.usage.prompt_tokens == prompt_ids.shape[1]
    assert whole.usage.completion_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"]) + ended
    sampled = [ask(temperature=1.0, seed=1234).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]
    cut = text[: text.index("Paris")]
    assert ask(stop=["Paris"]).choices[0].message.content == cut
    assert joined_text([c.model_dump() for c in ask(stop="Paris", stream=True)]) == cut
