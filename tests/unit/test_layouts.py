"""The forward layout choice (`parallel.decode`): auto picks gather when it fits every rank, else tp, else reshard."""

from __future__ import annotations

import pytest

from shardbook.rankd.parallel.layout import choose_layout

FITS = (True, "the gathered model (0.50 GiB) fits in half of the memory free per rank (8.00 GiB on cpu)")
MISFITS = (False, "the gathered model (9.00 GiB) does not fit in half of the memory free per rank (8.00 GiB on cpu)")


def test_auto_keeps_the_gathered_model_when_every_rank_has_room():
    layout, reason = choose_layout("auto", [FITS, FITS], tp_unavailable=None)
    assert layout == "gather" and reason.startswith(FITS[1])


def test_auto_picks_tp_when_one_rank_has_no_room_and_names_it():
    layout, reason = choose_layout("auto", [FITS, MISFITS], tp_unavailable=None)
    assert layout == "tp" and reason.startswith("on rank 1 the gathered model (9.00 GiB) does not fit")


def test_auto_falls_back_to_reshard_only_for_a_model_tp_cannot_run_and_says_why():
    layout, reason = choose_layout("auto", [MISFITS, MISFITS], tp_unavailable="tp does not support 'mixtral'")
    assert layout == "reshard" and "tensor parallel is not available (tp does not support 'mixtral')" in reason


@pytest.mark.parametrize("requested", ["tp", "gather", "reshard"])
def test_an_explicit_layout_is_kept_whatever_the_memory(requested):
    assert choose_layout(requested, [MISFITS, FITS], tp_unavailable=None) == (requested, "set by parallel.decode")


def test_explicit_tp_for_a_model_it_cannot_run_is_an_error():
    with pytest.raises(ValueError, match="does not support 'mixtral'"):
        choose_layout("tp", [FITS, FITS], tp_unavailable="parallel.decode tp does not support 'mixtral' models yet")
