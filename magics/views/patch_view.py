"""How an activation-patching sweep is shown: a heatmap (modules x positions) and a table of the largest effects."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any


@dataclass
class PatchTable:
    """The sweep as rows (module, position, token, metric when patched), with the raw result in ``result``."""

    rows: list[dict[str, Any]]
    result: dict[str, Any]

    def __repr__(self) -> str:
        r = self.result
        head = (
            f"{r['method']} patching: metric clean {r['clean_metric']:.4g}, corrupt {r['corrupt_metric']:.4g}; "
            "the largest effects:"
        )
        lines = [head, f"{'module':<36} {'pos':>3}  {'token':<12} metric"]
        for row in sorted(self.rows, key=lambda x: -abs(x["metric"] - r["corrupt_metric"]))[:15]:
            lines.append(f"{row['module']:<36} {row['position']:>3}  {row['token']!r:<12} {row['metric']:.4g}")
        return "\n".join(lines)


def patch_table(result: dict[str, Any]) -> PatchTable:
    effect = result["effect"]
    rows = [
        {"module": module, "position": pos, "token": token, "metric": float(effect[i, pos])}
        for i, module in enumerate(result["modules"])
        for pos, token in enumerate(result["tokens"])
    ]
    return PatchTable(rows, result)


def patch_heatmap_png(result: dict[str, Any], title: str) -> bytes:
    """Modules by positions, coloured by the metric with that output patched in (PNG bytes)."""
    from matplotlib.figure import Figure

    effect = result["effect"].float().numpy()
    modules, tokens = result["modules"], result["tokens"]
    fig = Figure(figsize=(1.0 + 0.6 * len(tokens), 1.2 + 0.3 * len(modules)))
    ax = fig.subplots()
    image = ax.imshow(effect, aspect="auto", cmap="RdBu_r")
    ax.set_xticks(range(len(tokens)), [repr(t)[1:-1][:8] for t in tokens], rotation=60, fontsize=7)
    ax.set_yticks(range(len(modules)), modules, fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="metric when patched")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    return out.getvalue()
