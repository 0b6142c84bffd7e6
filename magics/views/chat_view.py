"""How a streamed reply is shown: a widget whose text grows, or plain streamed text.

The widget's value is *replaced* at most ``MAX_UPDATES_PER_S`` times a second (appending to an
``Output`` widget resends everything each time, which is quadratic). When the reply ends the live
view turns into its final rendering in place: the reply's display is updated to text/markdown
and the status line's to HTML, and the widgets are closed. The reply is shown once, and saved
or converted notebooks show it without widget JavaScript.
"""

from __future__ import annotations

import html
import sys
import time

from IPython.display import display

MAX_UPDATES_PER_S = 20


class WidgetChatView:
    """An HTML widget holding the reply so far, and a status line under it, each in a display of its own."""

    def __init__(self):
        import ipywidgets as w

        self.reply = w.HTML(value=self._render(""))
        self.status = w.HTML(value="<i>generating…</i>")
        self.text = ""
        self._shown = ""
        self._last_update = 0.0
        self._reply_display = display(self.reply, display_id=True)
        self._status_display = display(self.status, display_id=True)

    @staticmethod
    def _render(text: str) -> str:
        return f"<div class='shardbook-reply' style='white-space: pre-wrap'>{html.escape(text)}</div>"

    def add(self, chunk: str) -> None:
        self.text += chunk
        if time.monotonic() - self._last_update >= 1 / MAX_UPDATES_PER_S:
            self._refresh()

    def _refresh(self) -> None:
        if self.text != self._shown:
            self.reply.value = self._render(self.text)
            self._shown = self.text
        self._last_update = time.monotonic()

    def finish(self, status: str, final_text: str) -> None:
        self.text = final_text
        self._settle(status)

    def fail(self, why: str) -> None:
        self._settle(f"failed: {why}")

    def _settle(self, status: str) -> None:
        """Replace the live widgets, in place, by the reply as markdown and the status as HTML; close the widgets."""
        self._reply_display.update({"text/markdown": self.text, "text/plain": self.text}, raw=True)
        self._status_display.update(
            {"text/html": f"<small>{html.escape(status)}</small>", "text/plain": f"[{status}]"}, raw=True
        )
        self.reply.close()
        self.status.close()


class TextChatView:
    """Chunks written to stdout, at most ``MAX_UPDATES_PER_S`` writes a second; the status line after."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.text = ""
        self._written = 0
        self._last_write = 0.0

    def add(self, chunk: str) -> None:
        self.text += chunk
        if time.monotonic() - self._last_write >= 1 / MAX_UPDATES_PER_S:
            self._write_pending()

    def _write_pending(self) -> None:
        if self._written < len(self.text):
            self.stream.write(self.text[self._written :])
            self.stream.flush()
            self._written = len(self.text)
        self._last_write = time.monotonic()

    def finish(self, status: str, final_text: str) -> None:
        if final_text.startswith(self.text):
            self.text = final_text
        self._write_pending()
        self.stream.write(f"\n[{status}]\n")
        self.stream.flush()

    def fail(self, why: str) -> None:
        self._write_pending()
        self.stream.write("\n")
        self.stream.flush()


class ScoresView:
    """A reply's tokens coloured by their probability, the top alternatives in each token's tooltip.

    Shown under ``%%chat --scores``; its plain-text form (saved notebooks, ``shardbook run``)
    writes each token with its probability.
    """

    def __init__(self, scores: list[dict]):
        self.scores = scores

    @staticmethod
    def _label(step: dict) -> str:
        return step["text"] or f"⟨{step['token_id']}⟩"  # an end-of-turn token decodes to nothing

    def _span(self, step: dict) -> str:
        others = [a for a in step["alternatives"] if a["token_id"] != step["token_id"]][:4]
        tip = "\n".join(
            [f"{self._label(step)!r} {step['prob']:.3f}"] + [f"{a['text']!r} {a['prob']:.3f}" for a in others]
        )
        hue = round(120 * step["prob"])  # red (unsure) to green (sure)
        return (
            f"<span title='{html.escape(tip, quote=True)}' style='background: hsl({hue}, 70%, 80%); "
            f"white-space: pre-wrap; color: black'>{html.escape(self._label(step))}</span>"
        )

    def _repr_html_(self) -> str:
        legend = "<small>colour: probability of each token (red low, green high); hover for the alternatives</small>"
        return f"<div class='shardbook-scores'>{''.join(self._span(s) for s in self.scores)}<br>{legend}</div>"

    def __repr__(self) -> str:
        return " ".join(f"{self._label(s)!r}:{s['prob']:.2f}" for s in self.scores)
