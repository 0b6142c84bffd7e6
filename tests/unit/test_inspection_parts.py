"""Pieces of the inspection tools that need no ranks: module globs, --layers, the lens table and heatmap."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

from shardbook.magics.inspection import layer_globs
from shardbook.magics.views.lens_view import heatmap_png, lens_table, short
from shardbook.rankd.inspection.tracing import Lens, glob_pattern

NAMES = [
    "model.layers.0",
    "model.layers.0.self_attn",
    "model.layers.0.self_attn.q_proj",
    "model.layers.1",
    "model.layers.12",
]


@pytest.mark.parametrize(
    "glob, matched",
    [
        (
            "model.layers.*",
            ["model.layers.0", "model.layers.1", "model.layers.12"],
        ),  # one name part, not the sub-modules
        ("model.layers.1", ["model.layers.1"]),
        ("model.layers.?", ["model.layers.0", "model.layers.1"]),
        ("model.layers.0.**", ["model.layers.0.self_attn", "model.layers.0.self_attn.q_proj"]),
        ("**.q_proj", ["model.layers.0.self_attn.q_proj"]),
    ],
)
def test_globs_match_dotted_names_part_by_part(glob, matched):
    assert [n for n in NAMES if glob_pattern(glob).match(n)] == matched


def test_layers_option_takes_indices_ranges_and_globs():
    layers = [f"model.layers.{i}" for i in range(4)]
    assert layer_globs(["0-1,3"], layers) == ["model.layers.0", "model.layers.1", "model.layers.3"]
    assert layer_globs(["2", "model.layers.*"], layers) == ["model.layers.2", "model.layers.*"]
    with pytest.raises(UsageError, match="the model has layers 0-3"):
        layer_globs(["2-9"], layers)


def test_lens_table_and_heatmap():
    lens = Lens(
        layers=["model.layers.0", "model.layers.1"],
        token_ids=torch.zeros(2, 3, 2, dtype=torch.long),
        probs=torch.tensor([[[0.5, 0.2]] * 3, [[0.9, 0.05]] * 3]),
        tokens=[[[" a", " b"]] * 3, [[" Paris", "\n"]] * 3],
    )
    table = lens_table(lens, ["The", " capital", " is"])
    assert (
        len(table.rows) == 6
        and table.rows[-1]["top_tokens"] == [" Paris", "\n"]
        and table.rows[-1]["top_probs"] == [0.9, 0.05]
    )
    assert "model.layers.1       2  ' is'        ' Paris' 0.90, '\\n' 0.05" in repr(table)
    assert heatmap_png(lens, ["The", " capital", " is"]).startswith(b"\x89PNG")


def test_heatmap_cells_show_whitespace_tokens():
    assert short(" ") == "␣" and short("\n") == "\\n" and short("") == "∅"
    assert short(" Paris") == " Paris" and short(" capitalism") == " capit…"
