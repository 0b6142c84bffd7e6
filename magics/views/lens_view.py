"""How the logit lens is shown: a heatmap (layers x positions, the top token written in each cell) and a table.

The heatmap is a PNG drawn on a matplotlib Figure of its own and displayed as an image, so it shows
the same in JupyterLab, in a saved notebook and in ``shardbook run``'s output.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

MAX_CELL_CHARS = 7


@dataclass
class LensTable:
    """The logit lens as rows: layer, position, the input token there, and the top next tokens with probabilities."""

    rows: list[dict[str, Any]]
    lens: Any
    """The underlying ``Lens`` (token ids and probabilities as tensors, [layers, positions, top])."""

    def __repr__(self) -> str:
        lines = [f"{'layer':<18} {'pos':>3}  {'input':<12} top tokens"]
        for row in self.rows:
            tops = ", ".join(f"{t!r} {p:.2f}" for t, p in zip(row["top_tokens"], row["top_probs"]))
            lines.append(f"{row['layer']:<18} {row['position']:>3}  {row['input']!r:<12} {tops}")
        return "\n".join(lines)


def lens_table(lens: Any, input_tokens: list[str]) -> LensTable:
    rows = [
        {
            "layer": layer,
            "position": pos,
            "input": input_tokens[pos],
            "top_tokens": lens.tokens[i][pos],
            "top_probs": [round(p, 4) for p in lens.probs[i, pos].tolist()],
        }
        for i, layer in enumerate(lens.layers)
        for pos in range(len(input_tokens))
    ]
    return LensTable(rows, lens)


def short(text: str) -> str:
    """A token as a heatmap cell shows it: whitespace made visible (a space as ␣), at most MAX_CELL_CHARS."""
    text = text.replace("\n", "\\n").replace("\t", "\\t")
    if not text.strip():
        text = text.replace(" ", "␣") or "∅"
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 1] + "…"


def heatmap_png(lens: Any, input_tokens: list[str], title: str = "logit lens") -> bytes:
    """Layers (rows, first at the bottom) x positions; colour = the top token's probability, its text in the cell."""
    from matplotlib.figure import Figure  # not pyplot: the notebook's own backend (inline plots) stays as it is

    probs = lens.probs[:, :, 0].numpy()
    num_layers, num_positions = probs.shape
    fig = Figure(figsize=(1.0 + 0.75 * num_positions, 0.8 + 0.28 * num_layers))
    ax = fig.add_subplot()
    image = ax.imshow(probs, origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=1)
    for layer in range(num_layers):
        for pos in range(num_positions):
            colour = "black" if probs[layer, pos] > 0.6 else "white"
            ax.text(pos, layer, short(lens.tokens[layer][pos][0]), ha="center", va="center", fontsize=7, color=colour)
    ax.set_xticks(range(num_positions), [short(t) for t in input_tokens], rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(num_layers), [name.rsplit(".", 1)[-1] for name in lens.layers], fontsize=7)
    ax.set(xlabel="input token (the lens predicts the next one)", ylabel="layer", title=title)
    fig.colorbar(image, ax=ax, label="probability of the top token")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    return out.getvalue()
