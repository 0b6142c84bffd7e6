"""The conversation rank 0 keeps for a chat: system prompt, chat-template options and turns, saved as JSON."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardbook.rankd.control.text import check_valid

THINKING_KEYS = ("enable_thinking", "thinking")
"""The families' thinking switches: Qwen3 and GLM read ``enable_thinking``, DeepSeek-V3.1 and V3.2 ``thinking``."""
MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")
"""What a kept turn sends back to the chat template (``interrupted`` is the history's own mark)."""
PYTHON_CONSTANTS = {"True": True, "False": False, "None": None}
"""Python's spellings read as JSON's: ``enable_thinking=False`` must not reach the template as the string 'False'."""


def parse_template_arg(text: str, flag: str = "--template-arg") -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(KEY, VALUE)``: VALUE as JSON when it parses (``false``, ``0.5``, ``"x"``, ``[...]``;
    Python's ``True`` / ``False`` / ``None`` too), else the text itself. ValueError naming the fix."""
    from shardbook.rankd.generation.engine import check_template_options  # on use: it brings in torch

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(
            f"{flag} needs KEY=VALUE (a chat-template keyword and its value), got {text!r}; "
            f"e.g. {flag} enable_thinking=false"
        )
    if raw in PYTHON_CONSTANTS:
        value = PYTHON_CONSTANTS[raw]
    else:
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
    try:
        check_template_options({key: value})
    except ValueError as e:
        raise ValueError(f"{flag} {text}: {e}") from e
    return key, value


def parse_template_args(texts: list[str] | None) -> dict[str, Any]:
    """Every ``KEY=VALUE`` of a repeated ``--template-arg``, later ones winning."""
    return dict(parse_template_arg(text) for text in texts or ())


def _reads(chat_template: str | dict | None, key: str) -> bool:
    """Whether the template's source names ``key`` as a variable (a word of its own, not an attribute)."""
    source = " ".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", source) is not None


def thinking_keys(chat_template: str | dict | None) -> tuple[str, ...]:
    """The thinking switches the template's source reads; both when it names neither (a template ignores a
    keyword it does not read, so setting both is harmless)."""
    return tuple(key for key in THINKING_KEYS if _reads(chat_template, key)) or THINKING_KEYS


def unread_template_options(chat_template: str | dict | None, options: dict[str, Any]) -> list[str]:
    """The option names the template never mentions: passed on, they change nothing (worth a notice)."""
    return [key for key in options if not _reads(chat_template, key)]


def template_options_for(chat_template: str | dict | None, thinking: bool | None, options: dict[str, Any]) -> dict:
    """What the chat template gets: the family's thinking switch (unless ``thinking`` is None), then ``options``."""
    switches = {} if thinking is None else dict.fromkeys(thinking_keys(chat_template), thinking)
    return {**switches, **options}


def describe_template_options(thinking: bool | None, options: dict[str, Any]) -> str:
    """``thinking off, persona="pirate"``: what a conversation passes to the template, for its history."""
    parts = [] if thinking is None else [f"thinking {'on' if thinking else 'off'}"]
    parts += [f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in options.items()]
    return ", ".join(parts)


def with_system_prompt(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """The messages the model sees: ``system_prompt`` first unless it is empty or the messages bring their own.

    The one place a conversation gets its system prompt, for ``%%chat``, the terminal chat, ``ChatModel`` and
    the HTTP endpoint alike, so the same question gets the same prompt whichever way it is asked.
    """
    if not system_prompt or any(m.get("role") == "system" for m in messages):
        return list(messages)
    return [{"role": "system", "content": system_prompt}, *messages]


@dataclass
class Conversation:
    """Messages in order; an interrupted reply stays in the history, marked ``interrupted``.

    ``thinking`` (None: the template's default) and ``template_options`` go to the chat template on every
    turn; like the system prompt they outlive :meth:`reset`.
    """

    system_prompt: str | None = None
    turns: list[dict[str, Any]] = field(default_factory=list)
    thinking: bool | None = None
    template_options: dict[str, Any] = field(default_factory=dict)

    def request_messages(self, user_text: str) -> list[dict[str, Any]]:
        """The whole conversation plus the new user message, as the chat template wants it: an assistant turn
        brings its ``reasoning_content`` and ``tool_calls``, a tool result its ``tool_call_id`` and ``name``
        (the template decides what to render; most drop earlier reasoning)."""
        history = [{k: v for k, v in t.items() if k in MESSAGE_KEYS} for t in self.turns]
        return with_system_prompt([*history, {"role": "user", "content": user_text}], self.system_prompt)

    def add_turn(self, user_text: str, reply: str, finish_reason: str, reasoning: str = "") -> None:
        """The user's message and the assistant's reply (its reasoning kept apart, as ``reasoning_content``)."""
        self.add_messages([{"role": "user", "content": user_text}], reply, finish_reason, reasoning)

    def add_messages(self, messages: list[dict[str, Any]], reply: str, finish_reason: str, reasoning: str = "") -> None:
        """`messages` (the user's, then a tool loop's calls and results), then the assistant's final reply."""
        from shardbook.kernel.api.replies import assistant_message

        self.turns.extend(messages)
        assistant = assistant_message(reply, reasoning)
        if finish_reason == "interrupted":
            assistant["interrupted"] = True
        self.turns.append(assistant)

    def reset(self) -> None:
        self.turns.clear()

    def to_json(self) -> dict[str, Any]:
        return {
            "system_prompt": self.system_prompt,
            "turns": self.turns,
            "thinking": self.thinking,
            "template_options": self.template_options,
        }

    def save(self, path: str | Path) -> Path:
        """Write the conversation as JSON; ValueError (one line: path, cause, fix) when the file cannot be written."""
        path = Path(path).expanduser()
        try:
            path.write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=2), encoding="utf-8")
        except OSError as e:
            raise ValueError(
                f"could not save the conversation to {path}: {e.strerror or e}; "
                "choose a path in a directory you can write to"
            ) from e
        return path

    @classmethod
    def load(cls, path: str | Path) -> Conversation:
        """Read a conversation saved by :meth:`save`; ValueError naming the file and what is wrong with it."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ValueError(f"no conversation file at {path}; save one with `%chat --save {path}`") from e
        except OSError as e:
            raise ValueError(f"could not read {path}: {e.strerror or e}; check the path and its permissions") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not a saved conversation: byte {e.start} is not UTF-8 text") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a saved conversation (invalid JSON at line {e.lineno}): {e.msg}") from e
        turns = data.get("turns") if isinstance(data, dict) else None
        if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns
        ):
            raise ValueError(
                f"{path} is not a saved conversation: expected "
                f"{{'system_prompt': ..., 'turns': [{{'role', 'content'}}, ...]}}"
            )
        system_prompt = data.get("system_prompt")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"{path} is not a saved conversation: system_prompt must be text or null")
        from shardbook.rankd.generation.engine import check_template_options

        thinking, options = data.get("thinking"), data.get("template_options") or {}
        if thinking is not None and not isinstance(thinking, bool):
            raise ValueError(f"{path} is not a saved conversation: thinking must be true, false or null")
        try:
            check_template_options(options)
        except ValueError as e:
            raise ValueError(f"{path} is not a saved conversation: {e}") from e
        for what, value in [
            ("the system prompt", system_prompt or ""),
            *((f"turn {i} ({t['role']})", t["content"]) for i, t in enumerate(turns)),
        ]:
            check_valid(value, f"{path}: {what}")
        return cls(system_prompt=system_prompt, turns=turns, thinking=thinking, template_options=options)

    def template_line(self) -> str:
        """``[template] thinking off, persona="pirate"``: what every turn passes to the chat template."""
        described = describe_template_options(self.thinking, self.template_options)
        return f"[template] {described or 'the chat template defaults (no options)'}"

    def history_text(self) -> str:
        lines = [f"[system] {self.system_prompt}"] if self.system_prompt else []
        if self.thinking is not None or self.template_options:
            lines.append(self.template_line())
        for turn in self.turns:
            lines.extend(turn_lines(turn))
        return "\n".join(lines) or "(empty conversation)"


def turn_lines(turn: dict[str, Any]) -> list[str]:
    """A kept turn as history lines: an assistant's reasoning on a line of its own before its answer, its tool
    calls as ``name(arguments)``, a tool's result under the tool's name."""
    role = turn["role"]
    if role == "tool":
        name = f" {turn['name']}" if turn.get("name") else ""
        return [f"[tool{name}] {turn['content']}"]
    mark = " (interrupted)" if turn.get("interrupted") else ""
    lines = [f"[{role} reasoning{mark}] {turn['reasoning_content']}"] if turn.get("reasoning_content") else []
    calls = turn.get("tool_calls") or []
    if turn["content"] or not calls:
        lines.append(f"[{role}{mark}] {turn['content']}")
    for call in calls:
        function = call.get("function", {})
        lines.append(f"[{role} calls] {function.get('name')}({json.dumps(function.get('arguments'))})")
    return lines
