"""The tool loop on rank 0: the model calls Python functions, rank 0 runs them, the results go back, until it answers.

``ChatModel.chat(messages, tools=[...])`` and ``%%chat --tools NAME`` run it. The functions reach the chat template
as its ``tools`` keyword, JSON schemas read from their signatures and docstrings (transformers'
``get_json_schema``). Each reply is read for calls in the model's own tool format (``tool_calls.py``); each call
runs here and its result goes back as a ``role: "tool"`` message: a tool that raises, a name no tool has, or
arguments that do not fit give the model the error's text instead. The loop ends when a reply calls nothing,
stops for another reason (``length``, ``interrupted``), or would go past ``max_steps`` calls. Every call is a
:class:`ToolStep` that keeps the prompt the model answered with it, an ordinary prompt for ``%trace``, ``%patch``
and interventions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from shardbook.kernel.api.replies import ReplyParts, assistant_message

if TYPE_CHECKING:
    from shardbook.kernel.api.reasoning import ReasoningFormat
    from shardbook.kernel.api.responses import ChatResponse
    from shardbook.kernel.api.tool_calls import ToolCall, ToolFormat
    from shardbook.kernel.ranks.runtime import Runtime

log = logging.getLogger(__name__)

MAX_TOOL_STEPS = 8
"""Tool calls one loop may run before it stops (``max_tool_steps``, ``%%chat --max-tool-steps``)."""


@dataclass(frozen=True)
class ToolStep:
    """One call of a tool loop: what the model called with which arguments, what came back, and its prompt."""

    name: str
    arguments: Any
    """The arguments the model gave, as a dict."""
    result: str
    """What the model was told: the function's return value as text (JSON unless it is a string), or the error."""
    failed: bool = False
    """The call raised, named no tool, or was interrupted: ``result`` says why."""
    call_id: str = ""
    messages: tuple[dict[str, Any], ...] = ()
    """The conversation the model answered with this call, as the chat template got it."""
    prompt: str = ""
    """That conversation rendered by the chat template, tools included: trace it like any prompt."""

    def describe(self) -> str:
        """``add({"a": 2, "b": 3}) -> 5`` (``-> error: ...`` when it failed)."""
        return f"{self.name}({json.dumps(self.arguments, ensure_ascii=False)}) -> {self.result}"


@dataclass(frozen=True)
class ModelReply:
    """One reply of the model in a loop: the response as generated (raw text), how to split it, what it answered."""

    response: ChatResponse
    parts: ReplyParts
    messages: list[dict[str, Any]]
    prompt: str


def tool_schemas(tools: list[Callable]) -> list[dict[str, Any]]:
    """The JSON schema of each function (``{"type": "function", "function": {...}}``); ValueError naming the
    function and the fix when one is not a function, lacks type hints or a docstring, or two share a name."""
    from transformers.utils import get_json_schema

    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError(f"tools must be a non-empty list of Python functions, got {tools!r}")
    schemas, names = [], set()
    for fn in tools:
        if not callable(fn):
            raise ValueError(f"tools must be Python functions; {fn!r} is not callable")
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(
                f"cannot describe the tool {getattr(fn, '__name__', fn)!r} to the model: {e}. A tool needs type "
                "hints on every argument and a Google-style docstring: a summary line, then `Args:` with one "
                "`name: description` line per argument"
            ) from e
        name = schema["function"]["name"]
        if name in names:
            raise ValueError(f"two tools are named {name!r}: give each function its own name")
        names.add(name)
        schemas.append(schema)
    return schemas


def call_tool(functions: dict[str, Callable], call: ToolCall) -> tuple[Any, str, bool]:
    """Run one call on rank 0: ``(arguments, result text, failed)``; whatever goes wrong becomes the result's text."""
    arguments = json.loads(call.arguments)  # the parsers give only a JSON object's text
    fn = functions.get(call.name)
    if fn is None:
        return arguments, f"error: there is no tool named {call.name!r}; the tools are {', '.join(functions)}", True
    try:
        value = fn(**arguments)
    except Exception as e:  # the model reads the error and may try again
        return arguments, f"error: {type(e).__name__}: {e}", True
    return arguments, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str), False


def template_call(call: ToolCall) -> dict[str, Any]:
    """A call as an assistant message carries it back to the template (arguments as a mapping, which templates
    iterate)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.loads(call.arguments)}}


class ToolLoop:
    """Runs the model and its tool calls until it answers; ``steps`` and ``messages`` (the assistant's calls and
    the tools' results, in order) grow as it goes, so an interrupted loop keeps what it did."""

    def __init__(
        self,
        tools: list[Callable],
        tool_format: ToolFormat,
        *,
        max_steps: int = MAX_TOOL_STEPS,
        on_step: Callable[[ToolStep], None] | None = None,
    ):
        if max_steps < 1:
            raise ValueError(f"max_tool_steps must be at least 1, got {max_steps}")
        self.schemas = tool_schemas(tools)
        self.functions = {s["function"]["name"]: fn for s, fn in zip(self.schemas, tools)}
        self.format = tool_format
        self.max_steps = max_steps
        self.on_step = on_step or (lambda step: None)
        self.steps: list[ToolStep] = []
        self.messages: list[dict[str, Any]] = []
        self.stopped = False
        self.limit_message: str | None = None
        """Why the loop stopped at its cap, when it did."""
        self.last: ChatResponse | None = None
        """The latest reply, split (its calls taken out of its text), with the steps so far."""

    def run(self, messages: list[dict[str, Any]], reply: Callable[[list[dict[str, Any]]], ModelReply]) -> ChatResponse:
        """The final reply (``steps`` set): `reply` asks the model once, with the conversation so far.

        The stop button stops the reply being generated (its stream's own stop), raises KeyboardInterrupt in the
        tool being run (``run_step``), and between the two ends the loop before it asks the model again."""
        from shardbook.kernel.ranks.foreground import sigint_calls

        with sigint_calls(self.stop):
            while True:
                asked = reply([*messages, *self.messages])
                response, parsed = asked.parts.split(asked.response)
                self.last = replace(response, steps=tuple(self.steps))
                if response.finish_reason != "stop" or not parsed.calls:
                    return self.last
                if len(self.steps) + len(parsed.calls) > self.max_steps:
                    self.limit_message = self.describe_limit(parsed.calls)
                    log.warning("%s", self.limit_message)
                    return self.last
                calls = [template_call(c) for c in parsed.calls]
                self.messages.append(assistant_message(parsed.content, response.reasoning, tool_calls=calls))
                for call in parsed.calls:
                    if self.stopped:
                        break
                    self.run_step(call, asked)
                if self.stopped:
                    self.last = replace(self.last, finish_reason="interrupted", steps=tuple(self.steps))
                    return self.last

    def reply_parts(self, reasoning: ReasoningFormat) -> ReplyParts:
        """How to split one of the loop's replies: its reasoning in `reasoning`, its calls in the loop's format,
        their values typed by the tools' parameter schemas (glm45's and minimax_m2's bare ``123`` stays the
        string ``"123"`` for a string parameter)."""
        parameters = {s["function"]["name"]: s["function"].get("parameters") or {} for s in self.schemas}
        return ReplyParts(reasoning, self.format, parameters)

    def stop(self) -> None:
        """End the loop before its next step or reply (an interrupt between them)."""
        self.stopped = True

    def run_step(self, call: ToolCall, asked: ModelReply) -> None:
        """Run one call and record it; an interrupt in the tool stops the loop there."""
        from shardbook.kernel.ranks.foreground import interrupts_raise

        try:
            with interrupts_raise():
                arguments, result, failed = call_tool(self.functions, call)
        except KeyboardInterrupt:
            self.stopped = True
            arguments, result, failed = json.loads(call.arguments), "error: interrupted", True
        step = ToolStep(call.name, arguments, result, failed, call.id, tuple(asked.messages), asked.prompt)
        self.steps.append(step)
        self.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result})
        self.on_step(step)

    def describe_limit(self, calls: tuple[ToolCall, ...]) -> str:
        names = ", ".join(c.name for c in calls)
        return (
            f"the tool loop stopped after {len(self.steps)} tool calls: the model's last reply calls {names} too, "
            f"beyond the cap of {self.max_steps}; raise it (max_tool_steps=, %%chat --max-tool-steps N) or "
            "continue the conversation"
        )


def tool_format(runtime: Runtime) -> ToolFormat:
    """The loaded model's tool-call format (the config's ``inference.tool_call_parser``, or found from the
    model); ValueError when it has none shardbook reads."""
    from shardbook.kernel.api.replies import configured_parser
    from shardbook.kernel.api.tool_calls import FORMATS, tool_format_for

    loaded = runtime.ctx0.state.get("loaded")
    if loaded is None:
        raise ValueError("no model is loaded: run `%load_sharded CONFIG` first")
    model_type = getattr(getattr(loaded.model, "config", None), "model_type", None)
    override = configured_parser(runtime, "tool_call_parser")
    fmt = tool_format_for(model_type, loaded.tokenizer.get_vocab(), override)
    if fmt is None and override == "none":
        raise ValueError(
            "the config's inference.tool_call_parser is none, so no reply is read for tool calls: set it to auto "
            f"(the model's own format) or to the format its chat template writes ({', '.join(FORMATS)}), e.g. "
            "`%load_sharded CONFIG --inference.tool_call_parser auto`"
        )
    if fmt is None:
        raise ValueError(
            f"the loaded model ({model_type}) has no tool-call format shardbook reads ({', '.join(FORMATS)}: "
            "found by its model type or its vocabulary's call tokens), so its replies cannot be read as tool "
            "calls; load a tool-calling model (Qwen3, GLM-4.5/5, DeepSeek-V3.1/V3.2, Kimi-K2, MiniMax-M2, gpt-oss), or "
            "name the format its chat template writes in the config's inference.tool_call_parser"
        )
    return fmt


class Chats(Protocol):
    """What the loop needs of a ``ChatModel`` (typed here so this module need not import ``chat.py``, which
    imports it)."""

    runtime: Runtime

    def build_request(self, messages: list[dict[str, Any]], **settings: Any) -> Any: ...

    def stream_request(self, request: Any, batch: bool) -> Any: ...


def chat_with_tools(
    model: Chats, messages: str | list[dict[str, Any]], tools: list[Callable], max_steps: int, **settings: Any
) -> ChatResponse:
    """``ChatModel.chat(tools=...)``: the loop with each reply waited for (an interrupt stops the reply, and the
    loop ends with the steps so far)."""
    from shardbook.kernel.api.replies import prompt_text, request_format

    loop = ToolLoop(tools, tool_format(model.runtime), max_steps=max_steps)
    options = dict(settings.pop("template_options", None) or {})
    batch = settings.pop("batch", False)

    def reply(asked: list[dict[str, Any]]) -> ModelReply:
        request = model.build_request(asked, template_options={**options, "tools": loop.schemas}, **settings)
        parts = loop.reply_parts(request_format(model.runtime, request))  # the template's errors before any rank runs
        stream = model.stream_request(request, batch)
        return ModelReply(stream.wait(), parts, request.messages, prompt_text(model.runtime, request))

    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return loop.run(list(messages), reply)
