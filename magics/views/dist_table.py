"""Rendering the ``%dist`` table: one row per rank with host, Slurm place, pid, device, backend, state, memory."""

from __future__ import annotations

import html
from typing import Any

COLUMNS = ("rank", "host", "pid", "device", "backend", "state", "memory")


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_text(memory: dict[str, int]) -> str:
    parts = [f"rss {format_bytes(memory['rss'])}"] if "rss" in memory else []
    if "device" in memory:
        parts.append(f"device {format_bytes(memory['device'])}")
    return ", ".join(parts) or "-"


def columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The columns, with ``slurm`` (node and job id) after ``host`` when the job runs under Slurm."""
    if any(r.get("slurm") for r in rows):
        return (*COLUMNS[:2], "slurm", *COLUMNS[2:])
    return COLUMNS


def cells(row: dict[str, Any], slurm: bool = False) -> list[str]:
    state = row["state"] + (f" ({row['dead_reason']})" if row.get("dead_reason") else "")
    return [
        str(row["rank"]),
        str(row["host"]),
        *([row.get("slurm") or "-"] if slurm else []),
        str(row["pid"]),
        str(row["device"]),
        str(row["backend"]),
        state,
        memory_text(row["memory"]),
    ]


def dist_text(rows: list[dict[str, Any]]) -> str:
    names = columns(rows)
    table = [list(names)] + [cells(r, "slurm" in names) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(names))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table)


def dist_html(rows: list[dict[str, Any]]) -> str:
    names = columns(rows)
    head = "".join(f"<th>{c}</th>" for c in names)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells(r, "slurm" in names)) + "</tr>" for r in rows
    )
    return f"<table class='shardbook-dist'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class DistTable:
    """Displays as an HTML table in notebooks and as aligned text elsewhere; ``note`` (the Slurm job's) below it."""

    def __init__(self, rows: list[dict[str, Any]], note: str = ""):
        self.rows, self.note = rows, note

    def _repr_html_(self) -> str:
        return dist_html(self.rows) + (f"<p>{html.escape(self.note)}</p>" if self.note else "")

    def __repr__(self) -> str:
        return dist_text(self.rows) + (f"\n\n{self.note}" if self.note else "")
