"""A live progress display: an ipywidgets bar in a notebook, a tqdm-style text line elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Any

STEP_LABELS = {
    "config": "reading config",
    "skeleton": "building skeleton",
    "shard": "sharding layers",
    "materialise": "allocating shards",
    "read": "reading weights",
    "finalise": "finishing",
}


def widgets_available(shell: Any) -> bool:
    """True in a kernel with a comm manager (a frontend can render widgets)."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class WidgetProgress:
    """An IntProgress bar with a label, updated in place."""

    def __init__(self, title: str):
        import ipywidgets as w
        from IPython.display import display

        self.bar = w.IntProgress(value=0, min=0, max=100, description=title, layout=w.Layout(width="60%"))
        self.label = w.Label("starting")
        self._last = 0.0
        display(w.HBox([self.bar, self.label]))

    def update(self, step: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:  # each update is a message to the frontend
            return
        self._last = now
        self.bar.value = _percent(step, done, total)
        self.label.value = f"{STEP_LABELS.get(step, step)} {done}/{total}"

    def close(self, ok: bool) -> None:
        self.bar.value = 100 if ok else self.bar.value
        self.bar.bar_style = "success" if ok else "danger"
        self.label.value = "done" if ok else "failed"


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
        percent = _percent(step, done, total)
        bar = "#" * (percent // 5) + "-" * (20 - percent // 5)
        self.stream.write(f"\r{self.title} [{bar}] {percent:3d}% {STEP_LABELS.get(step, step)} {done}/{total}   ")
        self.stream.flush()

    def close(self, ok: bool) -> None:
        self.stream.write("\n" if ok else " failed\n")
        self.stream.flush()


def _percent(step: str, done: int, total: int) -> int:
    """Overall percent: each step gets an equal share, reading the weights the largest."""
    weights = {"config": 5, "skeleton": 5, "shard": 10, "materialise": 10, "read": 60, "finalise": 10}
    before = sum(weight for name, weight in weights.items() if list(weights).index(name) < list(weights).index(step)) if step in weights else 0
    share = weights.get(step, 0) * (done / total if total else 1)
    return max(0, min(100, int(before + share)))


def progress_view(shell: Any, title: str):
    return WidgetProgress(title) if widgets_available(shell) else TextProgress(title)
