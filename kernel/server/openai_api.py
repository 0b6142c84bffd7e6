"""The OpenAI chat-completions protocol: request bodies checked and translated, replies and errors in its shapes.

Only what the ranks can honour is accepted: ``messages`` (system, developer, user, assistant, tool;
text content; an assistant's ``reasoning_content`` and ``tool_calls``), ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (``tool_request``), ``max_tokens`` / ``max_completion_tokens``,
``temperature`` (0 is greedy), ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, ``chat_template_kwargs`` (keywords for the chat template, JSON
scalars) and ``reasoning_effort``. Fields that change nothing at their default value (``n: 1``,
``logprobs: false``, ...) pass; any other field or value is a 400 naming it, never silently
ignored. Unset settings come from the loaded config's ``inference`` section, as for ``%%chat``.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from shardbook.kernel.server.tool_request import ToolRequest, ToolRequestError, parse_tools, tool_fields
from shardbook.rankd.generation.engine import MAX_STOP_CHARS, check_template_options
from shardbook.rankd.generation.sampling import MIN_TEMPERATURE

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
EXTRA_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}
"""Message keys beyond role and content (and an assistant's reasoning_content), per role."""
HANDLED = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "chat_template_kwargs",
    "reasoning_effort",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
HARMLESS_DEFAULTS = {
    "n": (1,),
    "logprobs": (False,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "functions": ([],),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "metadata": ({},),
}
"""Fields accepted only at a value that asks for nothing (``None`` always passes)."""
REASONING_EFFORTS = ("low", "medium", "high")
MAX_STOP_STRINGS = 4
MAX_INT_DIGITS = 4300
"""Longest integer literal a body may hold: Python's own limit on converting one (whatever
``sys.set_int_max_str_digits`` says), far beyond any field's range, so every field names its own."""
FINISH_REASONS = {"stop": "stop", "length": "length", "interrupted": "length", "error": "error"}
"""The engine's finish reasons in OpenAI's words: a reply stopped early (stop button, shutdown) was cut short;
one that failed (a rank died, a step raised) says ``error``, as vLLM does, never ``length``."""


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def generation_failed(cause: str) -> ApiError:
    """The 500 of a reply that failed on the ranks (``cause`` names what failed), whole or as a stream's last event."""
    return ApiError(
        500,
        f"{cause}. The reply is incomplete; send the request again once /health says 'ok' (a dead rank needs "
        "the kernel, or `shardbook serve`, restarted).",
        type="server_error",
        code="generation_failed",
    )


@dataclass(frozen=True)
class CompletionRequest:
    """A checked chat-completions request: what ``ChatModel.build_request`` takes, and how to answer."""

    model: str
    messages: list[dict[str, str]]
    settings: dict[str, Any]
    stop: list[str]
    stream: bool
    include_usage: bool
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keywords for the chat template (``enable_thinking``, ``thinking``, ...), checked to be JSON scalars."""
    reasoning_effort: str | None = None
    """``low``, ``medium`` or ``high``: mapped to the model's own switch (``reasoning_reply.template_options``)."""
    tools: ToolRequest = field(default_factory=ToolRequest)
    """The tools offered, ``tool_choice`` and ``parallel_tool_calls`` (none: no tools)."""


def load_body(raw: bytes) -> Any:
    """A request body's JSON, or ApiError(400) saying why it is not JSON this server can read."""
    try:
        return json.loads(raw, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to be an API request") from None


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise ApiError(
            400,
            f"the request body has an integer of {len(literal.lstrip('-'))} digits; no field takes one of more "
            f"than {MAX_INT_DIGITS} digits (a seed, say, is below 2**63): send the number the field needs",
        )
    return int(literal)


def parse_request(raw: bytes) -> CompletionRequest:
    """The request in ``raw`` (a JSON body), or ApiError(400) naming the first thing wrong with it."""
    body = load_body(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object with 'model' and 'messages'")
    check_fields(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: the id that GET /v1/models lists", param="model")
    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict) or {}
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    if set(options) - {"include_usage"}:
        raise ApiError(
            400, f"unsupported stream_options {sorted(set(options) - {'include_usage'})}", param="stream_options"
        )
    return CompletionRequest(
        model=model,
        messages=parse_messages(body.get("messages")),
        settings=parse_settings(body),
        stop=parse_stop(body.get("stop")),
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        chat_template_kwargs=parse_template_kwargs(body.get("chat_template_kwargs")),
        reasoning_effort=parse_reasoning_effort(body.get("reasoning_effort")),
        tools=checked(parse_tools, body),
    )


def checked(parse: Any, *args: Any) -> Any:
    """``parse(*args)``, its ToolRequestError as a 400 naming the field."""
    try:
        return parse(*args)
    except ToolRequestError as e:
        raise ApiError(400, str(e), param=e.param) from None


def parse_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """``chat_template_kwargs``: keyword names to JSON scalars, passed to the template (unknown ones too, as
    transformers passes them); a list or object value, or a keyword shardbook sets itself, is a 400 naming it."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ApiError(
            400, "'chat_template_kwargs' must be an object of keyword -> value", param="chat_template_kwargs"
        )
    for key, value in kwargs.items():
        param = f"chat_template_kwargs.{key}"
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise ApiError(
                400,
                f"'{param}' must be a string, number, boolean or null, got {json.dumps(value)[:80]}",
                param=param,
            )
        try:
            check_template_options({key: value})
        except ValueError as e:
            raise ApiError(400, f"'{param}': {e}", param=param) from None
    return dict(kwargs)


def parse_reasoning_effort(effort: Any) -> str | None:
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ApiError(
            400,
            f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {json.dumps(effort)[:80]}",
            param="reasoning_effort",
        )
    return effort


def check_fields(body: dict[str, Any]) -> None:
    for key, value in body.items():
        if key in HANDLED or value is None:
            continue
        if key not in HARMLESS_DEFAULTS:
            raise ApiError(400, f"unsupported field '{key}': this server does not implement it", param=key)
        if value not in HARMLESS_DEFAULTS[key]:
            raise ApiError(
                400, f"unsupported value for '{key}': only {HARMLESS_DEFAULTS[key][0]!r} is implemented", param=key
            )


def parse_messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        raise ApiError(400, "'messages' is required: a list of {role, content} objects", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    return [parse_message(m, i) for i, m in enumerate(messages)]


def parse_message(message: Any, i: int) -> dict[str, str]:
    """One message; an assistant's may bring back its ``reasoning_content`` (templates that keep the reasoning
    of the last turns, such as Qwen3's, read it). Keys set to null count as absent."""
    param = f"messages[{i}]"
    if isinstance(message, dict):
        message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role") if isinstance(message, dict) else None
    allowed = {"role", "content", "reasoning_content", *(EXTRA_KEYS.get(role, ()) if isinstance(role, str) else ())}
    if not isinstance(message, dict) or set(message) - allowed:
        raise ApiError(400, f"{param} must be an object with only {sorted(allowed)}", param=param)
    if role not in ROLES:
        raise ApiError(
            400, f"{param}.role {role!r} is not supported; use one of {sorted(ROLES)}", param=f"{param}.role"
        )
    content = message.get("content", "" if message.get("tool_calls") else None)  # content may be null beside calls
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{param}.content: only text parts are supported", param=f"{param}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{param}.content must be a string", param=f"{param}.content")
    parsed = {"role": ROLES[role], "content": content, **checked(tool_fields, message, role, param)}
    if "reasoning_content" in message:
        reasoning = message["reasoning_content"]
        if role != "assistant" or not isinstance(reasoning, str):
            raise ApiError(
                400,
                f"{param}.reasoning_content must be a string, on an assistant message",
                param=f"{param}.reasoning_content",
            )
        parsed["reasoning_content"] = reasoning
    return parsed


def parse_settings(body: dict[str, Any]) -> dict[str, Any]:
    """Generation settings given in the body, named as ``GenerationRequest`` names them."""
    settings: dict[str, Any] = {}
    for key in ("max_completion_tokens", "max_tokens"):
        value = _typed(body, key, int)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"'{key}' must be at least 1, got {value}", param=key)
            settings["max_new_tokens"] = value
            break
    temperature = _typed(body, "temperature", (int, float))
    if temperature is not None:
        check_temperature(temperature)
        settings["do_sample"] = temperature > 0
        if temperature > 0:
            settings["temperature"] = float(temperature)
    top_p = _typed(body, "top_p", (int, float))
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
        settings["top_p"] = float(top_p)
    seed = _typed(body, "seed", int)
    if seed is not None:
        if not 0 <= seed < 2**63:
            raise ApiError(400, f"'seed' must be in [0, 2**63), got {seed}", param="seed")
        settings["seed"] = seed
    return settings


def check_temperature(temperature: float) -> None:
    """ApiError(400) unless `temperature` is 0 (greedy) or in [MIN_TEMPERATURE, 2] (below it the logits overflow)."""
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= 2):
        message = f"'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, 2], got {temperature}"
        raise ApiError(400, message, param="temperature")


def parse_stop(stop: Any) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise ApiError(
            400, f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", param="stop"
        )
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ApiError(
            400, f"'stop': each stop string may have at most {MAX_STOP_CHARS} characters, got {longest}", param="stop"
        )
    return stops


def check_fits_context(context: int | None, num_prompt_tokens: int, max_new_tokens: int | None) -> None:
    """ApiError(400) when the prompt, or the prompt plus an explicit ``max_tokens``, exceeds the model's context."""
    if context is None:
        return
    wanted = num_prompt_tokens + (max_new_tokens or 1)
    if wanted > context:
        raise ApiError(
            400,
            f"this model's context is {context} tokens, but the messages take {num_prompt_tokens} and "
            f"{max_new_tokens or 1} more were requested: shorten the messages or lower max_tokens",
            param="max_tokens" if max_new_tokens and num_prompt_tokens < context else "messages",
            code="context_length_exceeded",
        )


# --- replies ------------------------------------------------------------------------------
def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def usage_body(response: Any) -> dict[str, Any]:
    return {
        "prompt_tokens": response.prompt_tokens,
        "completion_tokens": response.generated_tokens,
        "total_tokens": response.prompt_tokens + response.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": getattr(response, "cached_tokens", 0)},
    }


def completion_body(
    completion_id: str,
    model: str,
    response: Any,
    message: dict[str, Any] | None = None,
    usage: dict | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A whole reply; `message`, `usage` and `finish_reason` replace the plain ones (the reasoning apart, its
    tokens counted, the calls made)."""
    message = message or {"role": "assistant", "content": response.text}
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason or FINISH_REASONS[response.finish_reason],
                "logprobs": None,
            }
        ],
        "usage": usage or usage_body(response),
    }


def chunk_body(
    completion_id: str,
    model: str,
    delta: dict[str, str] | None,
    finish_reason: str | None = None,
    usage: dict[str, int] | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk; ``delta=None`` makes the usage chunk (no choices) that ends a stream with include_usage."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    chunk = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if include_usage:
        chunk["usage"] = usage
    return chunk


def models_body(model_id: str | None, created: int) -> dict[str, Any]:
    data = (
        [] if model_id is None else [{"id": model_id, "object": "model", "created": created, "owned_by": "shardbook"}]
    )
    return {"object": "list", "data": data}


def _typed(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        name = kind.__name__ if isinstance(kind, type) else "number"
        raise ApiError(400, f"'{key}' must be a {name}, got {json.dumps(value)}", param=key)
    return value
