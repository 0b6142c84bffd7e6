"""Pieces of the inspection tools that need no ranks: module globs, --layers, the lens table and heatmap, and
which rows of a batched forward an intervention sees."""

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


class _Flattens(torch.nn.Module):
    """[rows, tokens, features] in, [rows * tokens, features] out, like the experts of an MoE block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 1) * 1


class _Model(torch.nn.Sequential):
    """`module` as submodule "0" of a model of one process: a parameter (registration reads the device from one)
    and input embeddings with no tensor-parallel group."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def get_input_embeddings(self) -> torch.nn.Module:
        return self[0]


class _Pools(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 2)


@pytest.mark.parametrize("module", [torch.nn.Identity(), _Flattens()], ids=["per_row", "flattened"])
def test_an_intervention_sees_the_selected_rows_cut_to_their_tokens_only(module):
    """In the batch (`applied_to`), the function gets the selected rows without the padding columns before them and
    its result goes back into those rows; the other rows, and a forward with no selected row, pass untouched."""
    from shardbook.rankd.generation.intervention_state import Rows, applied_to
    from shardbook.rankd.inspection import interventions

    model, seen = _Model(module), []

    def plus_one(output, module_name):
        seen.append(tuple(output.shape))
        return output + 1

    interventions.add(model, {"plus_one": plus_one}, "plus_one", ["0"], on_input=False)
    x = torch.zeros(3, 5, 4)
    with applied_to(model, Rows((1,), batch=3, tokens=5, start=2)):
        out = model(x).view(3, 5, 4)
    with applied_to(model, Rows((), batch=3, tokens=5)):
        untouched = model(x)
    assert seen == ([(1, 3, 4)] if isinstance(module, torch.nn.Identity) else [(3, 4)])  # its row, its 3 tokens
    assert (out[1, 2:] == 1).all() and (out[1, :2] == 0).all() and (out[0] == 0).all() and (out[2] == 0).all()
    assert (untouched == 0).all()
    assert (model(x) == 1).all()  # outside the batch: every row, as before


def test_an_intervention_on_a_tensor_without_rows_fails_naming_its_shape():
    from shardbook.rankd.generation.intervention_state import Rows, applied_to
    from shardbook.rankd.inspection import interventions

    model = _Model(_Pools())
    interventions.add(model, {"f": lambda output, name: output + 1}, "f", ["0"], on_input=False)
    with applied_to(model, Rows((0,), batch=2, tokens=3)):
        out = model(torch.zeros(2, 3, 4))
    assert (out == 0).all()
    with pytest.raises(interventions.InterventionError, match=r"has shape \(24,\), not \[rows, tokens, \.\.\.\]"):
        interventions.raise_failures(model)
