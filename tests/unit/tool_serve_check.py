"""Run by test_tool_endpoint.py in a process of its own (a world of one rank with a process-wide runtime): a tiny
model taught here to answer a question with a hermes tool call and, given the tool's result, with an answer, served
on the batch and on ``--no-batch``; the openai client's round trip whole and streamed on both; then the same call
written in GLM's, DeepSeek's, Kimi's and MiniMax's formats (taught too), each read by a server started with that
family's ``tool_call_parser``, whole and streamed. Prints one JSON line of findings. The OpenAI Agents SDK and
LangChain (`agents_sdk`, `langchain`) run against 2 ranks in ``tests/e2e/test_agents_on_two_ranks.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
MODEL = "tiny-tools"
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TAUGHT_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
}
RESULT = {"role": "tool", "tool_call_id": "any", "content": "sunny"}
FAMILY_CALLS = {
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    "</invoke>\n</minimax:tool_call>",
}
"""The same call in the other families' formats, each answered to the question asked in the family's name."""
MARKERS = """<tool_call> </tool_call> <arg_key> </arg_key> <arg_value> </arg_value> <｜tool▁calls▁begin｜>
<｜tool▁call▁begin｜> <｜tool▁sep｜> <｜tool▁call▁end｜> <｜tool▁calls▁end｜> <|tool_calls_section_begin|>
<|tool_call_begin|> <|tool_call_argument_begin|> <|tool_call_end|> <|tool_calls_section_end|>
<minimax:tool_call> </minimax:tool_call>""".split()


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city's name.
    """
    return "sunny"


def taught_model(chat_template: str | None = None, extra: tuple = ()):
    """A tiny Llama and a tokenizer with the families' tool tags, taught the hermes call and the answer after its
    result, and the call in each other family's format when asked in that family's name (and the `extra`
    ``(messages, template options, reply)`` examples, under `chat_template` when given)."""
    from reasoning_serve_check import teach  # a sibling script: this one runs as a file too

    from tests.tiny import TOOLS_TEMPLATE, make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.add_tokens(MARKERS)  # as Qwen3's, GLM's, ...: ordinary added tokens, kept in the text
    tokenizer.chat_template = chat_template or TOOLS_TEMPLATE
    tools = {"tools": [TOOL]}
    examples = [(QUESTION, tools, CALL), ([*QUESTION, TAUGHT_CALL, RESULT], tools, ANSWER), *extra]
    examples += [(family_question(name), tools, call) for name, call in FAMILY_CALLS.items()]
    return teach(tokenizer, examples, steps=500), tokenizer


def family_question(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Weather in Paris? ({name})"}]


def family_calls(client, name: str) -> list:
    """The call read in family `name`'s format (the server started with that tool_call_parser), whole and streamed."""
    ask = dict(model=MODEL, messages=family_question(name), tools=[TOOL], temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**ask).choices[0]
    with client.chat.completions.stream(**ask) as stream:
        streamed = stream.get_final_completion().choices[0]
    return [
        [
            choice.finish_reason,
            [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []],
        ]
        for choice in (whole, streamed)
    ]


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

    from shardbook.kernel.server.server import Server
    from shardbook.kernel.server.state import ServeOptions

    torch.set_num_threads(1)  # before the model is taught
    model, tokenizer = taught_model()
    runtime, port, client = one_rank_serving(model, tokenizer, f"/models/{MODEL}")
    out: dict = {}
    for batch in (True, False):
        # hermes named: with every family's markers in its vocabulary, auto would choose deepseek_v31's
        server = Server(runtime, ServeOptions(port=port, batch=batch, tool_call_parser="hermes")).start()
        out["batch" if batch else "no_batch"] = round_trip(client)
        server.stop()
    for name in FAMILY_CALLS:
        server = Server(runtime, ServeOptions(port=port, tool_call_parser=name)).start()
        out[name] = family_calls(client, name)
        server.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
