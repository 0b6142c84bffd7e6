"""Rank 0's notebook cells drop the packed copies of linear weights as they start and end.

A cell's code may edit a weight behind its version counter (`weight.data[...] = ...`), which the packed copies
(`rankd/parallel/packed_linear.py`) would not notice; each is made again at its next use. A lone `%%chat` cell runs
no code of the user's, so a conversation's turns keep their copies.
"""

from __future__ import annotations

from typing import Any

from shardbook.rankd.control.dispatch import forget_packed_weights


def watch_cells(shell: Any) -> None:
    shell.events.register("pre_run_cell", _maybe_forget)
    shell.events.register("post_run_cell", lambda result: _maybe_forget(result.info))


def _maybe_forget(info: Any) -> None:
    if not (getattr(info, "raw_cell", None) or "").lstrip().startswith("%%chat"):
        forget_packed_weights()
