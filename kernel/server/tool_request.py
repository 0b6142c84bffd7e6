"""The tool fields of a chat-completions request, checked: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``role: "tool"`` messages and an assistant's ``tool_calls``, in the shapes the chat templates read.

Errors are ``ToolRequestError`` (a ValueError with the field's path), which ``openai_api`` turns into a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from shardbook.kernel.api.tool_calls import ToolCall

CHOICES = ("auto", "none", "required")


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """The tools a request offers and how the model may call them."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI function tools, as given: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    choice: str = "auto"
    """``auto``, ``none``, ``required``, or ``function`` (the model must call ``function``)."""
    function: str | None = None
    parallel: bool = True
    """False: only the first of a reply's calls is kept."""

    @property
    def wanted(self) -> bool:
        """Whether the model is offered tools (rendered into the prompt, its calls read from the reply)."""
        return bool(self.tools) and self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools=`` for the chat template (as transformers' ``apply_chat_template(tools=...)`` passes them)."""
        return self.tools if self.wanted else None

    def check_calls(self, calls: tuple[ToolCall, ...]) -> str | None:
        """Why the reply's `calls` do not answer this request (None when they do): a tool not offered, missing
        required arguments, or no call of the function ``tool_choice`` named."""
        schemas = self.schemas()
        for call in calls:
            if call.name not in schemas:
                return f"the model called {call.name!r}, which is not one of the tools offered ({', '.join(schemas)})"
            missing = [k for k in schemas[call.name].get("required", ()) if k not in json.loads(call.arguments)]
            if missing:
                return f"the call of {call.name} lacks the required arguments {missing}"
        if self.choice == "function" and self.function not in {c.name for c in calls}:
            return f"tool_choice asked for a call of {self.function}; the model did not call it"
        if self.choice == "required" and not calls:
            return "tool_choice 'required': the model called no tool"
        return None

    def schemas(self) -> dict[str, Any]:
        """Each function's parameters' schema (formats that write values bare read their types from it)."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}

    def kept(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        return calls if self.parallel else calls[:1]


def parse_tools(body: dict[str, Any]) -> ToolRequest:
    """The request's tool fields (absent: no tools); ToolRequestError naming the first one that is wrong."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolRequestError("'tools' must be a list of function tools", "tools")
    for i, tool in enumerate(tools):
        check_tool(tool, f"tools[{i}]")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise ToolRequestError(
            f"'tools' names a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}", "tools"
        )
    choice, function = parse_choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return ToolRequest(tools, choice, function, True if parallel is None else parallel)


def check_tool(tool: Any, param: str) -> None:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise ToolRequestError(
            f'{param} must be a function tool, {{"type": "function", "function": {{"name": ...}}}}, got '
            f"{json.dumps(tool)[:120]}: this server implements function tools only",
            param,
        )
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolRequestError(f"{param}.function.name must be a non-empty string", f"{param}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolRequestError(
            f"{param}.function.parameters must be a JSON schema object", f"{param}.function.parameters"
        )


def parse_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in CHOICES:
        if choice == "required" and not names:
            raise ToolRequestError("'tool_choice' is 'required' but the request offers no 'tools'", "tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict):
        raise ToolRequestError(
            "'tool_choice' must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if function.get("name") not in names:
        raise ToolRequestError(
            f"'tool_choice' names the function {function.get('name')!r}, which is not one of 'tools' ({names})",
            "tool_choice",
        )
    return "function", function["name"]


def tool_fields(message: dict[str, Any], role: str, param: str) -> dict[str, Any]:
    """The tool keys of a message as the templates read them: a tool result's ``tool_call_id`` (and ``name``), an
    assistant's ``tool_calls`` with each call's ``arguments`` checked to be the JSON text of an object and kept as
    the client wrote it (every rank hands it to the template as a mapping that joins onto text as that text:
    ``rankd/generation/chat_template.py``)."""
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ToolRequestError(
                f"{param}.tool_call_id is required on a tool message: the id of the call it answers",
                f"{param}.tool_call_id",
            )
        name = message.get("name")
        return {"tool_call_id": call_id, **({"name": name} if isinstance(name, str) else {})}
    calls = message.get("tool_calls")
    if calls is None:
        return {}
    if role != "assistant" or not isinstance(calls, list):
        raise ToolRequestError(f"{param}.tool_calls must be a list, on an assistant message", f"{param}.tool_calls")
    return {"tool_calls": [template_call(call, f"{param}.tool_calls[{i}]") for i, call in enumerate(calls)]}


def template_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolRequestError(
            f'{param} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', param
        )
    arguments = function.get("arguments") or "{}"
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        raise ToolRequestError(
            f"{param}.function.arguments must be the JSON text of an object", f"{param}.function.arguments"
        )
    kept = arguments if isinstance(arguments, str) else decoded
    out = {"type": "function", "function": {"name": function["name"], "arguments": kept}}
    return {"id": call["id"], **out} if isinstance(call.get("id"), str) else out
