"""A command's per-rank failures, grouped: the same failure on several ranks counts once.

Shared by the magics (which render a RankError) and the terminal chat (which prints one line).
"""

from __future__ import annotations

import re
from typing import Any

from shardbook.kernel.ranks.pool import Outcome


def outcome_errors(outcome: Outcome) -> dict[int, dict[str, Any]]:
    """Every rank's failure: its reported error, or why it never finished."""
    errors = {
        rank: reply.get("error") or {"ename": "RankFailed", "evalue": f"status {reply.get('status')}", "traceback": []}
        for rank, reply in outcome.replies.items()
        if reply.get("status") != "ok"
    }
    why = "timed out" if outcome.timed_out else "did not stop after the interrupt"
    for rank in outcome.stuck:
        errors[rank] = {"ename": "RankStuck", "evalue": f"{why}; still busy (see %dist)", "traceback": []}
    return errors


def group_errors(errors: dict[int, dict[str, Any]]) -> list[tuple[list[int], dict[str, Any]]]:
    """Group per-rank errors by (exception name, message), ranks ascending."""
    groups: dict[tuple[str, str], tuple[list[int], dict[str, Any]]] = {}
    for rank in sorted(errors):
        error = errors[rank]
        key = (error.get("ename", "?"), error.get("evalue", ""))
        groups.setdefault(key, ([], error))[0].append(rank)
    return list(groups.values())


def ranks_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


COLLECTIVE_FAILURE = re.compile(r"timed out|timeout|connection reset|connection closed|gloo|nccl|hccl", re.IGNORECASE)
RESTART_HINT = (
    "A collective failed or timed out on some ranks, which usually leaves the process group unusable: "
    "restart the kernel before running anything that communicates between ranks."
)


def restart_hint(errors: dict[int, dict[str, Any]]) -> str | None:
    """The advice to restart, when a rank's failure came from a collective (the group may be broken)."""
    if any(COLLECTIVE_FAILURE.search(f"{e.get('ename')}: {e.get('evalue')}") for e in errors.values()):
        return RESTART_HINT
    return None


def describe_failures(outcome: Outcome) -> str:
    """One line: each distinct failure once, with the ranks it happened on ('' when none failed)."""
    errors = outcome_errors(outcome)
    text = "; ".join(f"{ranks_label(ranks)}: {e.get('ename')}: {e.get('evalue')}" for ranks, e in group_errors(errors))
    hint = restart_hint(errors)
    return f"{text}. {hint}" if hint else text
