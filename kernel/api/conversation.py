"""The conversation rank 0 keeps for a chat: system prompt and turns, saved and loaded as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardbook.rankd.control.text import check_valid


@dataclass
class Conversation:
    """Messages in order; an interrupted reply stays in the history, marked ``interrupted``."""

    system_prompt: str | None = None
    turns: list[dict[str, Any]] = field(default_factory=list)

    def request_messages(self, user_text: str) -> list[dict[str, str]]:
        """The whole conversation plus the new user message, as the chat template wants it."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        history = [{"role": t["role"], "content": t["content"]} for t in self.turns]
        return [*system, *history, {"role": "user", "content": user_text}]

    def add_turn(self, user_text: str, reply: str, finish_reason: str) -> None:
        self.turns.append({"role": "user", "content": user_text})
        assistant = {"role": "assistant", "content": reply}
        if finish_reason == "interrupted":
            assistant["interrupted"] = True
        self.turns.append(assistant)

    def reset(self) -> None:
        self.turns.clear()

    def to_json(self) -> dict[str, Any]:
        return {"system_prompt": self.system_prompt, "turns": self.turns}

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
        for what, value in [
            ("the system prompt", system_prompt or ""),
            *((f"turn {i} ({t['role']})", t["content"]) for i, t in enumerate(turns)),
        ]:
            check_valid(value, f"{path}: {what}")
        return cls(system_prompt=system_prompt, turns=turns)

    def history_text(self) -> str:
        lines = [f"[system] {self.system_prompt}"] if self.system_prompt else []
        for turn in self.turns:
            mark = " (interrupted)" if turn.get("interrupted") else ""
            lines.append(f"[{turn['role']}{mark}] {turn['content']}")
        return "\n".join(lines) or "(empty conversation)"
