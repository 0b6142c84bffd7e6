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
    "warm-up": "warming up (gathering every layer)",
}
STEP_SHARES = {"config": 15, "skeleton": 10, "shard": 20, "read": 45, "finalise": 10, "warm-up": 0}
"""Each step's share of the bar, in percent and in the order the steps run (from measured load times); the
warm-up forward (gather only) is shown at 100%, as the load's last step."""


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
        self.stream.write(f"\r{self.title} [{bar}] {share:3d}% {step_text(step, done, total)}   ")
        self.stream.flush()

    def close(self, ok: bool) -> None:
        self.stream.write("\n" if ok else " failed\n")
        self.stream.flush()


def step_text(step: str, done: int, total: int) -> str:
    """``reading weights 3/6``: the step as people read it, and how far it is."""
    return f"{STEP_LABELS.get(step, step)} {done}/{total}"


def percent(step: str, done: int, total: int) -> int:
    """Overall percent: the shares of the steps before ``step``, plus the finished part of its own."""
    if step not in STEP_SHARES:
        return 0
    steps = list(STEP_SHARES)
    before = sum(STEP_SHARES[name] for name in steps[: steps.index(step)])
    share = STEP_SHARES[step] * (done / total if total else 1)
    return max(0, min(100, int(before + share)))
