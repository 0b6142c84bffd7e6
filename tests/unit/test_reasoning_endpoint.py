"""Reasoning on /v1/chat/completions through the `openai` client, on the batch and on ``--no-batch``.

The server runs in this process over scripted ranks: the reply depends on the prompt the chat template rendered
(so `chat_template_kwargs` and `reasoning_effort` are seen to reach it), and comes in pieces cut inside the tags.
The last test serves a tiny model taught to answer with a think block (``reasoning_serve_check.py``): real tokens.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from shardbook.kernel.ranks.generation_queue import GenerationQueue
from shardbook.kernel.server import batch_reply
from shardbook.kernel.server.server import Server
from shardbook.kernel.server.state import ServeOptions
from shardbook.rankd.config.schema import InferenceConfig
from shardbook.rankd.generation.batching import SequenceResult, StreamDelta
from shardbook.rankd.generation.engine import build_prompt_ids
from tests.checks import run_check
from tests.tiny import CHATML_TEMPLATE, make_tokenizer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(60)

THINK_TEMPLATE = CHATML_TEMPLATE.replace(
    "'\\n' + message['content']",
    "'\\n' + ('<think>' + message['reasoning_content'] + '</think>' if message['reasoning_content'] else '')"
    " + message['content']",  # as Qwen3's: an earlier turn's reasoning, when the client sends it back
).replace(
    "{{ '<|im_start|>assistant\\n' }}",
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}",  # as DeepSeek-V3.1 / GLM-5: the prompt opens the block
)
HARMONY_TEMPLATE = (
    "{{ '<|start|>system<|message|>Reasoning: ' + (reasoning_effort or 'medium') + '<|end|>' }}"
    "{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)
THOUGHT = "The user greets me; greet back."
THINKING = ["The user greets", " me; greet back.\n</", "think>\n\nHel", "lo!"]
HARMONY = [
    "<|channel|>analysis<|message|>Low effort",
    ": just greet.<|e",
    "nd|><|start|>assistant<|channel|>final<|mess",
    "age|>Hello!",
]


def reply_to(prompt: str) -> list[str]:
    """What the scripted model says: it thinks when its prompt opens a think block or asks for low effort."""
    if prompt.endswith("<think>\n"):
        return THINKING
    if "<think>An earlier thought.</think>" in prompt:
        return ["I remember thinking it."]
    if "Reasoning: low" in prompt:
        return HARMONY
    return ["Hello!"]


class ScriptedPool:
    """The ranks of ``--no-batch``: each generate command answers `reply_to` its rendered prompt, in pieces."""

    def __init__(self, tokenizer):
        self.world = SimpleNamespace(world_size=2)
        self.tokenizer = tokenizer

    def run(self, kind, args, targets, on_output, on_notice, on_start=None):
        on_start(SimpleNamespace(id="c"))
        request = args["request"]
        prompt = build_prompt_ids(self.tokenizer, request["messages"], request["template_options"])[0].tolist()
        pieces = reply_to(self.tokenizer.decode(prompt))
        for piece in pieces:
            on_output(0, "text", {"text": piece})
        value = dict(
            text="".join(pieces), prompt_tokens=len(prompt), generated_tokens=len(pieces), finish_reason="stop",
            time_to_first_token_s=0.0, tokens_per_s=0.0, seed=0, scores=None,
        )  # fmt: skip
        return SimpleNamespace(ok=True, replies={0: {"status": "ok", "value": value}}, stuck=[])

    def interrupt(self, command):
        pass

    def health(self):
        return {"can_serve": True, "loading": False, "busy": False, "dead_ranks": [], "silent_ranks": [], "ranks": []}


class FakeModel:
    def __init__(self, model_type: str):
        self.config = LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=400)
        self.config.model_type = model_type
        self.generation_config = SimpleNamespace(eos_token_id=None)

    def parameters(self):
        """Where the weights are (the batch sizes itself by the device)."""
        return iter([torch.zeros(1)])


class FakeHandle:
    def stop(self):
        pass


SUBMITTED: list = []


def scripted_submit(runtime, sequence, on_done=None, on_delta=None, **kwargs):
    """The batch's ranks: the sequence's reply is `reply_to` its prompt, streamed in pieces."""
    SUBMITTED.append(sequence)
    tokenizer = runtime.ctx0.state["loaded"].tokenizer
    pieces = reply_to(tokenizer.decode(sequence.prompt_ids))
    for piece in pieces if on_delta else ():
        on_delta(StreamDelta(piece, [0], [], []))
    on_done(SequenceResult(token_ids=[0] * len(pieces), text="".join(pieces), finish_reason="stop", prompt_tokens=3))
    return FakeHandle()


def family_tokenizer(family: str):
    tokenizer = make_tokenizer()
    if family == "think":
        tokenizer.add_tokens(["<think>", "</think>"])
        tokenizer.chat_template = THINK_TEMPLATE
    else:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|message|>", "<|end|>"]})
        tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


@pytest.fixture(params=["batch", "no-batch"])
def serve(request, monkeypatch):
    monkeypatch.setattr(batch_reply, "submit", scripted_submit)
    SUBMITTED.clear()
    servers = []

    def start(family: str, **options):
        tokenizer = family_tokenizer(family)
        loaded = SimpleNamespace(
            tokenizer=tokenizer, model=FakeModel("qwen3" if family == "think" else "gpt_oss"), summary={}
        )
        config = SimpleNamespace(model=SimpleNamespace(model_name_or_path="/models/m"), inference=InferenceConfig())
        runtime = SimpleNamespace(
            pool=ScriptedPool(tokenizer),
            generation_queue=GenerationQueue(),
            ctx0=SimpleNamespace(state={"config": config, "loaded": loaded}),
            server=None,
        )
        server = Server(runtime, ServeOptions(port=0, batch=request.param == "batch", **options)).start()
        servers.append(server)
        return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0), tokenizer

    start.batch = request.param == "batch"
    yield start
    for server in servers:
        server.stop()


def streamed(client, **fields):
    chunks = list(
        client.chat.completions.create(model="m", stream=True, stream_options={"include_usage": True}, **fields)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning, content, chunks[-1].usage


def test_think_tags_reasoning_apart_and_thinking_switched_off(serve):
    client, tokenizer = serve("think")
    hello = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="m", messages=hello)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, "Hello!")
    thought_tokens = len(tokenizer(THOUGHT, add_special_tokens=False)["input_ids"])
    assert whole.usage.completion_tokens_details.reasoning_tokens == thought_tokens
    reasoning, content, usage = streamed(client, messages=hello)
    assert (reasoning, content) == (THOUGHT, "Hello!")
    assert usage.completion_tokens_details.reasoning_tokens == thought_tokens
    off = client.chat.completions.create(
        model="m", messages=hello, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert (off.choices[0].message.reasoning_content, off.choices[0].message.content) == (None, "Hello!")
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert streamed(client, messages=hello, extra_body={"chat_template_kwargs": {"enable_thinking": False}})[:2] == (
        "",
        "Hello!",
    )
    effort = client.chat.completions.create(model="m", messages=hello, reasoning_effort="low")
    assert effort.choices[0].message.reasoning_content == THOUGHT  # any effort keeps thinking on
    assert bool(SUBMITTED) == serve.batch  # each path was the one it says


def test_harmony_channels_apart_and_reasoning_effort_reaches_the_template(serve):
    client, _ = serve("harmony")
    hello = [{"role": "user", "content": "Hello"}]
    low = client.chat.completions.create(model="m", messages=hello, reasoning_effort="low")
    assert (low.choices[0].message.reasoning_content, low.choices[0].message.content) == (
        "Low effort: just greet.",
        "Hello!",
    )
    assert streamed(client, messages=hello, reasoning_effort="low")[:2] == ("Low effort: just greet.", "Hello!")
    medium = client.chat.completions.create(model="m", messages=hello)  # the template's default: no script
    assert (medium.choices[0].message.reasoning_content, medium.choices[0].message.content) == (None, "Hello!")


@pytest.mark.parametrize(
    "fields, param, why",
    [
        (
            {"chat_template_kwargs": {"enable_thinking": [True]}},
            "chat_template_kwargs.enable_thinking",
            "boolean or null",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", "set by shardbook itself"),
        ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs", "object of keyword -> value"),
        ({"reasoning_effort": "max"}, "reasoning_effort", "one of low, medium, high"),
    ],
)
def test_template_fields_that_are_refused(serve, fields, param, why):
    client, _ = serve("think")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], extra_body=fields)
    assert refused.value.body["param"] == param and why in refused.value.body["message"]


def test_reasoning_effort_becomes_the_familys_switch(caplog):
    from shardbook.kernel.server.reasoning_reply import template_options

    deepseek = SimpleNamespace(chat_template="{% if thinking %}<think>{% else %}</think>{% endif %}")
    assert template_options("think", deepseek, {}, "high") == {"thinking": True}  # off by default: turned on
    assert template_options("think", deepseek, {}, None) == {}
    assert template_options("harmony", deepseek, {"x": 1}, "low") == {"x": 1, "reasoning_effort": "low"}
    with caplog.at_level("WARNING"):
        assert template_options("think", deepseek, {"thinking": False}, "low") == {"thinking": False}
    assert "reasoning_effort 'low' ignored" in caplog.text  # the request's own keyword wins, said so


def test_an_assistant_turn_may_bring_its_reasoning_back(serve):
    client, _ = serve("think")
    turns = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!", "reasoning_content": "An earlier thought.", "refusal": None},
        {"role": "user", "content": "What did you think?"},
    ]
    reply = client.chat.completions.create(
        model="m", messages=turns, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert reply.choices[0].message.content == "I remember thinking it."  # the template saw the reasoning
    turns[0]["reasoning_content"] = "users do not reason"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=turns)
    assert refused.value.body["param"] == "messages[0].reasoning_content"


def test_the_reasoning_parser_is_chosen_by_flags_and_reaches_the_reply(serve):
    from shardbook.kernel.cli.main import build_parser
    from shardbook.kernel.cli.serve import serve_options, split_flags
    from shardbook.magics.arguments import parse_line
    from shardbook.magics.serve import ServeMagics

    args = build_parser().parse_args(["serve", "--reasoning-parser", "harmony", "demo", "--tool-call-parser", "glm45"])
    split_flags(args)
    options = serve_options(args)
    assert (options.reasoning_parser, options.tool_call_parser) == ("harmony", "glm45")
    magic = parse_line(ServeMagics.serve, "--reasoning-parser none --tool-call-parser kimi_k2")
    assert (magic.reasoning_parser, magic.tool_call_parser) == ("none", "kimi_k2")
    assert parse_line(ServeMagics.serve, "").reasoning_parser is None  # not given: the config's applies
    args = build_parser().parse_args(["serve", "demo", "--reasoning-parser", "qwen3"])
    split_flags(args)
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen3': use one of auto, think, harmony, none"):
        serve_options(args)
    client, _ = serve("think", reasoning_parser="none")  # the think tags read as text: all of it content
    message = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}]).choices[0]
    assert (getattr(message.message, "reasoning_content", None), message.message.content) == (None, "".join(THINKING))


@pytest.mark.timeout(240)
def test_a_taught_model_reasons_apart_on_both_paths():
    """Real generated tokens: a tiny model taught (in `reasoning_serve_check.py`) to answer with a think block."""
    found = run_check(Path(__file__).with_name("reasoning_serve_check.py"), timeout=220)
    for where in ("batch", "no_batch"):
        assert found[f"{where}_whole"] == ["Greet back.", "Hello!"], found
        assert found[f"{where}_stream"] == ["Greet back.", "Hello!"], found
        assert found[f"{where}_reasoning_tokens"] == found["expected_reasoning_tokens"]
        assert found[f"{where}_stream_reasoning_tokens"] == found["expected_reasoning_tokens"]
        reasoning, content, finish = found[f"{where}_cut"]  # cut while thinking: all of it reasoning
        assert reasoning and "Greet back.".startswith(reasoning) and (content, finish) == ("", "length"), found
