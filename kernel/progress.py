"""Load progress as text: step names people read, overall percent, a tqdm-style line."""

from __future__ import annotations

import sys
import time

STEP_LABELS = {
    "config": "reading config",
    "skeleton": "building skeleton",
    "shard": "sharding layers",
    "read": "reading weights",
    "finalise": "finishing",
}


class TextProgress:
    """``title [#####-----] 50% reading weights 3/6`` rewritten in place on stderr, at most 10 times a second."""

    def __init__(self, title: str, stream=None):
        self.title = title
        self.stream = stream or sys.__stderr__
        self._last = 0.0

    def update(self, step: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        share = percent(step, done, total)
        bar = "#" * (share // 5) + "-" * (20 - share // 5)
        self.stream.write(f"\r{self.title} [{bar}] {share:3d}% {STEP_LABELS.get(step, step)} {done}/{total}   ")
        self.stream.flush()

    def close(self, ok: bool) -> None:
        self.stream.write("\n" if ok else " failed\n")
        self.stream.flush()


def percent(step: str, done: int, total: int) -> int:
    """Overall percent: each step gets a fixed share, reading the weights the largest."""
    weights = {"config": 15, "skeleton": 10, "shard": 20, "read": 45, "finalise": 10}
    before = sum(weight for name, weight in weights.items() if list(weights).index(name) < list(weights).index(step)) if step in weights else 0
    share = weights.get(step, 0) * (done / total if total else 1)
    return max(0, min(100, int(before + share)))
