"""A live progress display: an ipywidgets bar in a notebook, a tqdm-style text line elsewhere."""

from __future__ import annotations

import time
from typing import Any

from shardbook.kernel.api.progress import TextProgress, percent, step_text


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
        self.bar.value = percent(step, done, total)
        self.label.value = step_text(step, done, total)

    def close(self, ok: bool) -> None:
        self.bar.value = 100 if ok else self.bar.value
        self.bar.bar_style = "success" if ok else "danger"
        self.label.value = "done" if ok else "failed"


def progress_view(shell: Any, title: str):
    return WidgetProgress(title) if widgets_available(shell) else TextProgress(title)
