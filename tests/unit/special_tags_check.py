"""Run by test_special_tags.py in a process of its own (a world of one rank with a process-wide runtime): a tiny
model whose tokenizer has gpt-oss's harmony markers and Kimi-K2's call tokens as special tokens, taught to answer a
question with harmony reasoning and a call, the tool's result with harmony reasoning and a final answer, and the
question asked in Kimi's name with a Kimi call; served on the batch and on ``--no-batch``, read whole and streamed
through the openai client; and a greeting with harmony reasoning, read by ChatModel (as %%chat and the terminal
chat read it). Prints one JSON line of findings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tool_serve_check import FAMILY_CALLS, QUESTION, RESULT, TAUGHT_CALL, TOOL  # a sibling script

MODEL = "tiny-harmony"
HARMONY_TAGS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>"]
KIMI_TAGS = [
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
]
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
ANSWER = "<|channel|>analysis<|message|>It said sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
KIMI_QUESTION = [{"role": "user", "content": "Weather in Paris? (kimi_k2)"}]
GREETING = "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"


def taught_model():
    """A tiny Llama and a ChatML tokenizer whose harmony and Kimi tags are special tokens, taught the three replies."""
    from reasoning_serve_check import teach

    from tests.tiny import TOOLS_TEMPLATE, make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.add_tokens([*HARMONY_TAGS, *KIMI_TAGS], special_tokens=True)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tools = {"tools": [TOOL]}
    examples = [
        (QUESTION, tools, CALL),
        ([*QUESTION, TAUGHT_CALL, RESULT], tools, ANSWER),
        (KIMI_QUESTION, tools, FAMILY_CALLS["kimi_k2"]),
        ([{"role": "user", "content": "Hello"}], {}, GREETING),
    ]
    return teach(tokenizer, examples, steps=500), tokenizer


def read(client, messages: list) -> list:
    """[finish_reason, reasoning, content, calls] of the reply, whole and streamed (deltas joined)."""
    ask = dict(model=MODEL, messages=messages, tools=[TOOL], temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**ask).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **ask) if c.choices]
    streamed = [
        next(c.finish_reason for c in chunks if c.finish_reason),
        "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks),
        "".join(c.delta.content or "" for c in chunks),
        [(t.function.name, json.loads(t.function.arguments)) for c in chunks for t in c.delta.tool_calls or []],
    ]
    message = whole.message
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]
    return [[whole.finish_reason, getattr(message, "reasoning_content", None), message.content, calls], streamed]


def main() -> None:
    from batch_server_check import one_rank_serving

    from shardbook.kernel.api.chat import ChatModel
    from shardbook.kernel.server.server import Server
    from shardbook.kernel.server.state import ServeOptions

    torch.set_num_threads(1)  # before the model is taught
    model, tokenizer = taught_model()
    runtime, port, client = one_rank_serving(model, tokenizer, f"/models/{MODEL}")
    out: dict = {}
    for batch in (True, False):
        where = "batch" if batch else "no_batch"
        # harmony named: with Kimi's tokens in the vocabulary too, auto would choose kimi_k2
        server = Server(runtime, ServeOptions(port=port, batch=batch, tool_call_parser="harmony")).start()
        out[f"{where}_call"] = read(client, QUESTION)
        out[f"{where}_answer"] = read(client, [*QUESTION, TAUGHT_CALL, RESULT])
        server.stop()
        options = ServeOptions(port=port, batch=batch, tool_call_parser="kimi_k2", reasoning_parser="none")
        server = Server(runtime, options).start()
        out[f"{where}_kimi"] = read(client, KIMI_QUESTION)
        server.stop()
        reply = ChatModel(runtime).chat("Hello", batch=batch, max_new_tokens=60, do_sample=False)
        out[f"{where}_chat_model"] = [reply.reasoning, reply.text]  # %%chat's and the terminal's reply
    print(json.dumps(out))


if __name__ == "__main__":
    main()
