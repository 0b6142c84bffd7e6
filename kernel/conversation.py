"""The conversation rank 0 keeps for a chat: system prompt and turns, saved and loaded as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
        path = Path(path).expanduser()
        path.write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Conversation":
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ValueError(f"no conversation file at {path}; save one with `%chat --save {path}`") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a saved conversation (invalid JSON at line {e.lineno}): {e.msg}") from e
        turns = data.get("turns") if isinstance(data, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) and {"role", "content"} <= set(t) for t in turns):
            raise ValueError(f"{path} is not a saved conversation: expected {{'system_prompt': ..., 'turns': [{{'role', 'content'}}, ...]}}")
        return cls(system_prompt=data.get("system_prompt"), turns=turns)

    def history_text(self) -> str:
        lines = [f"[system] {self.system_prompt}"] if self.system_prompt else []
        for turn in self.turns:
            mark = " (interrupted)" if turn.get("interrupted") else ""
            lines.append(f"[{turn['role']}{mark}] {turn['content']}")
        return "\n".join(lines) or "(empty conversation)"
