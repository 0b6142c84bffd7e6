"""HTML and text renderings of the load summary and the ``%shards`` table."""

from __future__ import annotations

import html
from typing import Any

from shardbook.magics.views.dist_table import format_bytes


class Table:
    """Rows of strings that display as an HTML table in notebooks and aligned text elsewhere."""

    def __init__(self, header: list[str], rows: list[list[str]], title: str = ""):
        self.header, self.rows, self.title = header, rows, title

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self.rows)
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __repr__(self) -> str:
        table = [self.header, *self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(self.header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
        return "\n".join(([self.title] if self.title else []) + lines)


def summary_table(summary: dict[str, Any]) -> Table:
    """Two parts in one table: the model facts, then one line per rank."""
    mesh = " x ".join(f"{axis}={n}" for axis, n in zip(summary["mesh_axes"], summary["mesh_shape"]))
    facts = [
        ["architecture", summary["architecture"]],
        ["parameters", f"{summary['num_parameters'] / 1e6:.1f} M ({format_bytes(summary['full_param_bytes'])})"],
        ["dtype / device", f"{summary['dtype']} / {summary['device']}"],
        ["mesh", f"{mesh} ({summary['world_size']} ranks)"],
        ["decode", f"{summary['decode']} — {summary['decode_reason']}"],
        ["load time", f"{summary['load_seconds']:.2f} s"],
    ]
    if summary.get("quantized_tensors"):
        facts.append(["checkpoint", quantized_line(summary)])
    if summary.get("fp8_weights"):
        facts.append(["fp8 weights", fp8_line(summary)])
    if "warm_up_s" in summary:  # gather: one forward inside the load gathered every layer
        facts.append(["warm-up forward", f"{summary['warm_up_s']:.2f} s (every layer gathered, kept)"])
    if "replicated_param_bytes" in summary:  # the tp layout: what every rank keeps whole
        facts.append(["kept whole on every rank", format_bytes(summary["replicated_param_bytes"]) + " per rank"])
    if "kv_cache_bytes_per_token" in summary:
        per_token = ", ".join(format_bytes(b) for b in summary["kv_cache_bytes_per_token"])
        facts.append(["KV cache per token", per_token + (" (rank 0, 1, ...)" if summary["decode"] == "tp" else "")])
    if "kv_cache_tokens" in summary:
        facts.append(["batch KV cache", f"{summary['kv_cache_tokens']:,} tokens ({summary['kv_cache_tokens_reason']})"])
    if "config_source" in summary:
        facts.insert(0, ["config", summary["config_source"]])
    for rank, local in enumerate(summary["local_param_bytes"]):
        device = summary["device_bytes"][rank]
        memory = f"rss {format_bytes(summary['rss_bytes'][rank])}" + (
            f", device {format_bytes(device)}" if device is not None else ""
        )
        facts.append([f"rank {rank}", f"local params {format_bytes(local)}; {memory}"])
    return Table(["", "loaded " + summary["model_path"]], facts)


def quantized_line(summary: dict[str, Any]) -> str:
    """The quantized formats read, what they became, and the bytes on disk against the bytes each rank holds."""
    formats = "; ".join(f"{n} tensor(s) in {name}" for name, n in summary["quantized_tensors"].items())
    held = ", ".join(format_bytes(b) for b in summary["local_param_bytes"])
    kept = _fp8_kept(summary)
    fate = f"{kept} kept in FP8 (below), the rest dequantized to" if kept else "dequantized to"
    return (
        f"{formats}, {fate} {summary['dtype']}; {format_bytes(summary['checkpoint_bytes'])} on disk, "
        f"{format_bytes(summary['full_param_bytes'])} dequantized, held per rank: {held}"
    )


def fp8_line(summary: dict[str, Any]) -> str:
    """What `model.fp8_weights` came to: which layers and experts hold FP8 codes, and how they compute."""
    kept = _fp8_kept(summary)
    if not kept:
        return summary["fp8_weights"]
    kernel = summary["fp8_kernel_modules"] + summary.get("fp8_kernel_experts", 0)
    reference = summary["fp8_kept_modules"] + summary.get("fp8_kept_experts", 0) - kernel
    return (
        f"{kept} held as e4m3 codes with their scales ({format_bytes(summary['fp8_scale_bytes'])} of scales on "
        f"rank 0), {kernel} computed by torch's FP8 matmul, {reference} by the reference path; the other quantized "
        f"tensors dequantized to {summary['dtype']}"
    )


def _fp8_kept(summary: dict[str, Any]) -> str:
    """What holds FP8 codes: 'N linear layer(s)', 'M fused expert tensor(s) (...)' or both joined by 'and';
    '' when nothing does."""
    linears, experts = summary.get("fp8_kept_modules", 0), summary.get("fp8_kept_experts", 0)
    words = [f"{linears} linear layer(s)"] if linears else []
    if experts:
        words.append(f"{experts} fused expert tensor(s) (the routed experts' gate_up_proj and down_proj)")
    return " and ".join(words)


def shards_table(rows: list[dict[str, Any]], world_size: int, prefix: str) -> Table:
    header = ["parameter", "global shape", "dtype", "placement", *[f"rank {r}" for r in range(world_size)]]
    body = []
    for row in rows:
        local = [_shape(row["local"].get(r)) if row["local"] else _shape(row["shape"]) for r in range(world_size)]
        body.append([row["name"], _shape(row["shape"]), row["dtype"], row["placement"], *local])
    title = f"{len(rows)} parameter(s) under {prefix!r}" if prefix else f"{len(rows)} parameter(s)"
    return Table(header, body, title)


def _shape(shape: list[int] | None) -> str:
    return "-" if shape is None else "[" + ", ".join(map(str, shape)) + "]"
