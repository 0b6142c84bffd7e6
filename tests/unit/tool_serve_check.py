"""Run by test_tool_endpoint.py in a process of its own (a world of one rank with a process-wide runtime): the
tiny tool model of ``tests/taught.py``, served on the batch and on ``--no-batch``; the openai client's hermes
round trip whole and streamed on both; the same call written in each other family's format (harmony's and Kimi's
tags special tokens) read by a server started with that family's ``tool_call_parser``, whole and streamed, and
harmony's answer to the call's result; and a greeting with harmony reasoning read by ChatModel (as %%chat and the
terminal chat read it). Prints one JSON line of findings. The OpenAI Agents SDK and LangChain (`agents_sdk`,
`langchain`) and every family's call run against 2 ranks in ``tests/e2e/test_agents_on_two_ranks.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.taught import FAMILY_CALLS, QUESTION, RESULT, TAUGHT_CALL, TOOL, family_question, get_weather

MODEL = "tiny-tools"


def read(client, messages: list) -> list:
    """[finish_reason, reasoning, content, calls] of the reply, whole and streamed (the deltas joined, calls by
    their index)."""
    ask = dict(model=MODEL, messages=messages, tools=[TOOL], temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**ask).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **ask) if c.choices]
    calls: dict = {}
    for call in (t for c in chunks for t in c.delta.tool_calls or ()):
        name, arguments = calls.get(call.index, ("", ""))
        calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
    streamed = [
        next(c.finish_reason for c in chunks if c.finish_reason),
        "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks),
        "".join(c.delta.content or "" for c in chunks),
        [(name, json.loads(arguments)) for name, arguments in (calls[i] for i in sorted(calls))],
    ]
    message = whole.message
    made = [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]
    return [[whole.finish_reason, getattr(message, "reasoning_content", None), message.content, made], streamed]


def round_trip(client) -> dict:
    """The openai client: the call whole and through its stream helper's accumulation, then the answer."""
    ask = dict(model=MODEL, messages=QUESTION, tools=[TOOL], temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**ask).choices[0]
    with client.chat.completions.stream(**ask) as stream:
        streamed = stream.get_final_completion().choices[0]
    calls = whole.message.tool_calls or []
    turns = [*QUESTION, whole.message.model_dump(exclude_none=True)]
    turns += [
        {"role": "tool", "tool_call_id": c.id, "content": get_weather(**json.loads(c.function.arguments))}
        for c in calls
    ]
    answer = client.chat.completions.create(**{**ask, "messages": turns}).choices[0]
    return {
        "whole": [whole.finish_reason, [(c.function.name, json.loads(c.function.arguments)) for c in calls]],
        "stream": [
            streamed.finish_reason,
            [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls or []],
        ],
        "answer": [answer.finish_reason, answer.message.content],
    }


def agents_sdk(base_url: str) -> str:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # tracing would post to OpenAI
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(base_url=base_url, api_key="none"))
    agent = Agent(
        name="weather",
        model=model,
        tools=[function_tool(get_weather)],
        model_settings=ModelSettings(temperature=0, max_tokens=80),
    )
    return Runner.run_sync(agent, QUESTION[0]["content"]).final_output


def langchain(base_url: str) -> list:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="none", temperature=0, max_tokens=80, max_retries=0)
    bound = llm.bind_tools([get_weather])
    asked = [HumanMessage(QUESTION[0]["content"])]
    called = bound.invoke(asked)
    chunks = list(bound.stream(asked))
    streamed = sum(chunks[1:], chunks[0])
    results = [ToolMessage(get_weather(**c["args"]), tool_call_id=c["id"]) for c in called.tool_calls]
    answer = bound.invoke([*asked, called, *results])
    return [
        [(c["name"], c["args"]) for c in called.tool_calls],
        [(c["name"], c["args"]) for c in streamed.tool_calls],
        answer.content,
    ]


def main() -> None:
    from batch_server_check import one_rank_serving  # a sibling script: this one runs as a file too

    from shardbook.kernel.api.chat import ChatModel
    from shardbook.kernel.server.server import Server
    from shardbook.kernel.server.state import ServeOptions
    from tests.taught import tool_model

    torch.set_num_threads(1)  # before the model is taught
    model, tokenizer = tool_model()
    runtime, port, client = one_rank_serving(model, tokenizer, f"/models/{MODEL}")
    out: dict = {}
    for batch in (True, False):
        where = "batch" if batch else "no_batch"
        # each parser named: with every family's tags in the vocabulary, auto would choose deepseek_v31's
        for name in FAMILY_CALLS:
            server = Server(runtime, ServeOptions(port=port, batch=batch, tool_call_parser=name)).start()
            out[f"{where}_{name}"] = round_trip(client) if name == "hermes" else read(client, family_question(name))
            if name == "harmony":
                out[f"{where}_harmony_answer"] = read(client, [*family_question(name), TAUGHT_CALL, RESULT])
            server.stop()
        reply = ChatModel(runtime).chat("Hello", batch=batch, max_new_tokens=60, do_sample=False)
        out[f"{where}_chat_model"] = [reply.reasoning, reply.text]  # %%chat's and the terminal's reply
    print(json.dumps(out))


if __name__ == "__main__":
    main()
