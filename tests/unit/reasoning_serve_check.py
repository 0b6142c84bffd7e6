"""Run by test_reasoning_endpoint.py in a process of its own (a world of one rank with a process-wide runtime): a
tiny model taught here to answer with a think block, served on the batch and on ``--no-batch``, asked through the
openai client whole, streamed and cut inside its reasoning. Prints one JSON line of findings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
REPLY = "<think>Greet back.</think>Hello!"
QUESTION = [{"role": "user", "content": "Hello"}]


def taught_model():
    """A tiny Llama and a tokenizer with think tags (as Qwen3's: ordinary added tokens, kept in the text), trained
    until its greedy reply to QUESTION is REPLY."""
    from tests.taught import THINK_TAGS, rendered, tag_tokenizer, teach

    tokenizer = tag_tokenizer(THINK_TAGS)
    return teach(tokenizer, rendered(tokenizer, [(QUESTION, {}, REPLY)]), max_steps=300), tokenizer


def main() -> None:
    from batch_server_check import one_rank_serving  # a sibling script: this one runs as a file too

    from shardbook.kernel.server.server import Server
    from shardbook.kernel.server.state import ServeOptions

    torch.set_num_threads(1)  # before the model is taught
    model, tokenizer = taught_model()
    runtime, port, client = one_rank_serving(model, tokenizer, "/models/tiny-think")
    ask = dict(model="tiny-think", messages=QUESTION, max_tokens=20, temperature=0)
    out: dict = {}
    for batch in (True, False):
        where = "batch" if batch else "no_batch"
        server = Server(runtime, ServeOptions(port=port, batch=batch)).start()
        whole = client.chat.completions.create(**ask)
        message = whole.choices[0].message
        out[f"{where}_whole"] = [message.reasoning_content, message.content]
        out[f"{where}_reasoning_tokens"] = whole.usage.completion_tokens_details.reasoning_tokens
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        out[f"{where}_stream"] = [
            "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas),
        ]
        out[f"{where}_stream_reasoning_tokens"] = chunks[-1].usage.completion_tokens_details.reasoning_tokens
        cut = client.chat.completions.create(**{**ask, "max_tokens": 3}).choices[0]
        out[f"{where}_cut"] = [cut.message.reasoning_content, cut.message.content, cut.finish_reason]
        server.stop()
    out["expected_reasoning_tokens"] = len(tokenizer("Greet back.", add_special_tokens=False)["input_ids"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
