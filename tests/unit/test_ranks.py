"""Rank specifications for %%rank."""

import pytest
from IPython.core.error import UsageError

from shardbook.magics.ranks import parse_rank_spec


@pytest.mark.parametrize("spec, ranks", [("1", [1]), ("0,2", [0, 2]), ("1-3", [1, 2, 3]), ("3,0-1,1", [0, 1, 3]), (" 2 ", [2])])
def test_valid_specs(spec, ranks):
    assert parse_rank_spec(spec, 4) == ranks


@pytest.mark.parametrize("spec, message", [
    ("4", "rank 4 outside the world: this kernel has 4 ranks (0-3)"),
    ("2-9", "ranks 4, 5, 6, 7, 8, 9 outside the world"),
    ("a", "bad rank spec 'a'"),
    ("1,,2", "an empty item"),
    ("3-1", "descending"),
    ("-1", "bad rank spec"),
    ("1-2-3", "bad rank spec"),
])
def test_invalid_specs_state_the_world(spec, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_rank_spec(spec, 4)
