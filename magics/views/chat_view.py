"""How a streamed reply is shown: a widget whose text grows, or plain streamed text.

The widget's value is *replaced* at most ``MAX_UPDATES_PER_S`` times a second (appending to an
``Output`` widget resends everything each time, which is quadratic). When the reply ends the live
view turns into its final rendering in place: the reply's display is updated to text/markdown
and the status line's to HTML, and the widgets are closed. The reply is shown once, and saved
or converted notebooks show it without widget JavaScript.
"""

from __future__ import annotations

import html
import json
import sys
import time

from IPython.display import display

from shardbook.kernel.api.reasoning import Split
from shardbook.kernel.api.replies import ANSWER_MARK, REASONING_MARK, marked

MAX_UPDATES_PER_S = 20


class WidgetChatView:
    """The reply so far in an HTML widget, under a collapsible "Reasoning" part (hidden until the model reasons),
    and a status line, each in a display of its own. ``add`` takes :class:`Split` pieces."""

    def __init__(self):
        import ipywidgets as w

        self.thoughts = w.HTML(value=self._render("", "shardbook-reasoning"))
        self.reasoning_part = w.Accordion(children=[self.thoughts], titles=("Reasoning",))
        self.reasoning_part.layout.display = "none"
        self.reply = w.HTML(value=self._render(""))
        self.status = w.HTML(value="<i>generating…</i>")
        self.whole = Split()
        self._shown = Split()
        self._last_update = 0.0
        self._reply_display = display(w.VBox([self.reasoning_part, self.reply]), display_id=True)
        self._status_display = display(self.status, display_id=True)

    @property
    def text(self) -> str:
        return self.whole.content

    @staticmethod
    def _render(text: str, kind: str = "shardbook-reply") -> str:
        return f"<div class='{kind}' style='white-space: pre-wrap'>{html.escape(text)}</div>"

    def add(self, piece: Split) -> None:
        self.whole += piece
        if time.monotonic() - self._last_update >= 1 / MAX_UPDATES_PER_S:
            self._refresh()

    def _refresh(self) -> None:
        """Replace the values that changed (never append): the reasoning part shows itself on its first text."""
        if self.whole == self._shown:  # nothing new (a tag held back): the next piece may show at once
            return
        if self.whole.reasoning != self._shown.reasoning:
            self.thoughts.value = self._render(self.whole.reasoning, "shardbook-reasoning")
            self.reasoning_part.layout.display = None
        if self.whole.content != self._shown.content:
            self.reply.value = self._render(self.whole.content)
        self._shown = self.whole
        self._last_update = time.monotonic()

    def finish(self, status: str, final: Split) -> None:
        self.whole = final
        self._settle(status)

    def fail(self, why: str) -> None:
        self._settle(f"failed: {why}")

    def _settle(self, status: str) -> None:
        """Replace the live widgets, in place, by the reply as markdown and the status as HTML; close the widgets."""
        self._reply_display.update(final_data(self.whole), raw=True)
        self._status_display.update(
            {"text/html": f"<small>{html.escape(status)}</small>", "text/plain": f"[{status}]"}, raw=True
        )
        for widget in (self.reply, self.thoughts, self.reasoning_part, self.status):
            widget.close()


def final_data(reply: Split) -> dict[str, str]:
    """A finished reply as display data: the answer as markdown, under its reasoning (if any) in a collapsed
    ``<details>`` block quoted and headed "Reasoning"; the plain text marks the two parts too."""
    if not reply.reasoning:
        return {"text/markdown": reply.content, "text/plain": reply.content}
    quoted = "\n".join(f"> {line}" for line in reply.reasoning.splitlines())
    return {
        "text/markdown": f"<details><summary>Reasoning</summary>\n\n{quoted}\n\n</details>\n\n{reply.content}",
        "text/plain": f"{REASONING_MARK}\n{reply.reasoning}\n{ANSWER_MARK}\n{reply.content}",
    }


class TextChatView:
    """Chunks written to stdout, at most ``MAX_UPDATES_PER_S`` writes a second, the reasoning between
    ``[reasoning]`` and ``[answer]`` marks; the status line after. ``add`` takes :class:`Split` pieces."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.text = ""
        """What was (or is about to be) written, marks included."""
        self.in_reasoning: bool | None = None
        self._written = 0
        self._last_write = 0.0

    def add(self, piece: Split) -> None:
        self.text += marked(piece, self)
        if time.monotonic() - self._last_write >= 1 / MAX_UPDATES_PER_S:
            self._write_pending()

    def _write_pending(self) -> None:
        if self._written < len(self.text):
            self.stream.write(self.text[self._written :])
            self.stream.flush()
            self._written = len(self.text)
        self._last_write = time.monotonic()

    def finish(self, status: str, final: Split | None = None) -> None:
        self._write_pending()
        self.stream.write(f"\n[{status}]\n")
        self.stream.flush()

    def fail(self, why: str) -> None:
        self._write_pending()
        self.stream.write("\n")
        self.stream.flush()


def show_step(step) -> None:
    """Display one call of a tool loop (:class:`~shardbook.kernel.api.tools.ToolStep`) as it runs: the tool, its
    arguments and what the model is told back."""
    arguments = json.dumps(step.arguments, ensure_ascii=False)
    verdict = "failed" if step.failed else "returned"
    markdown = f"🔧 **{html.escape(step.name)}** `{arguments}` {verdict}:\n\n```\n{step.result}\n```"
    display({"text/markdown": markdown, "text/plain": f"[tool] {step.describe()}"}, raw=True)


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
