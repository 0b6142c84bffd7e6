"""The model's chat template applied to a conversation, the same on every rank: earlier tool calls' arguments in
the shape the template reads, and any failure of the template as one error naming it.

Templates disagree on a call's ``arguments``. transformers' tool-use convention hands them a mapping, which most
templates iterate or write with ``| tojson`` (vLLM decodes the OpenAI API's JSON text to a mapping before
rendering, for this); DeepSeek-V3's and V3.1's own templates join them onto text (``... +
tool['function']['arguments'] + ...``), which only a string allows. transformers rebuilds the template's inputs
from plain JSON types, so no value can be both: a template that joins ``arguments`` onto text (``+`` or ``~``,
found in its syntax tree) gets them as JSON text, the very text the call came with when it came as text; any
other template gets a mapping.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from jinja2 import Environment, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template raised while rendering a conversation: what the user gave it, not a fault of the model."""


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template`` on the messages, each earlier call's arguments in the shape the template
    reads; whatever the template raises (jinja's ``TemplateError`` from its own ``raise_exception``, a
    ``TypeError`` on a value of another shape, a syntax error, ...) is a :class:`ChatTemplateError` naming the
    template, the cause and the fix."""
    try:
        as_text = joins_arguments(tokenizer.get_chat_template(None, kwargs.get("tools")))
        return tokenizer.apply_chat_template(template_messages(messages, as_text), **kwargs)
    except Exception as e:
        raise ChatTemplateError(
            f"the model's chat template cannot render this conversation: it raised {type(e).__name__}: {e}. "
            "The template refused what it was given (the messages, their roles and order, a tool call or result, "
            "or a chat-template option), not the model: change the conversation or the options as its message "
            "says, or use a chat template written for such a conversation"
        ) from e


@lru_cache(maxsize=8)
def joins_arguments(template: str) -> bool:
    """Whether `template` joins a call's ``arguments`` onto text: an operand of ``+`` or ``~`` that is
    ``X.arguments``, ``X['arguments']``, or a name set to one of them. A template this cannot parse gets
    mappings, transformers' convention (rendering it then names its error)."""
    try:
        tree = template_environment(template).parse(template)
    except Exception:  # the template's own render reports what is wrong with it
        return False
    names = {
        a.target.name for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name) and is_arguments(a.node)
    }
    for node in tree.find_all((nodes.Add, nodes.Concat)):
        operands = (node.left, node.right) if isinstance(node, nodes.Add) else node.nodes
        if any(is_arguments(o) or (isinstance(o, nodes.Name) and o.name in names) for o in operands):
            return True
    return False


def template_environment(template: str) -> Environment:
    """The Jinja environment transformers renders chat templates in (its extensions, such as ``{% generation %}``,
    parse only there); a sandboxed one with loop controls where this transformers has no such helper (it is
    private to transformers, so it may move)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return _compile_jinja_template(template).environment


def is_arguments(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Getattr):
        return node.attr == "arguments"
    return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "arguments"


def template_messages(messages: list[dict[str, Any]], as_text: bool) -> list[dict[str, Any]]:
    """Copies of the messages with each assistant tool call's ``arguments`` as JSON text (`as_text`) or as a
    mapping (from the JSON text of an object, as vLLM decodes it); the caller's messages are left as they are."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [with_arguments(call, as_text) for call in calls]}
        out.append(message)
    return out


def with_arguments(call: Any, as_text: bool) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or "arguments" not in function:
        return call
    arguments = function["arguments"]
    if as_text and isinstance(arguments, Mapping):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not as_text and isinstance(arguments, str):
        arguments = decoded_object(arguments)
    return {**call, "function": {**function, "arguments": arguments}}


def decoded_object(text: str) -> Any:
    """The object `text` is the JSON of; `text` itself when it is not one (the template gets what was sent)."""
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError:
        return text
    return decoded if isinstance(decoded, dict) else text
