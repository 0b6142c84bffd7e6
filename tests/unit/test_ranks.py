"""Rank specifications for %%rank."""

import time
import tracemalloc

import pytest
from IPython.core.error import UsageError

from shardbook.magics.ranks import parse_rank_spec


@pytest.mark.parametrize(
    "spec, ranks", [("1", [1]), ("0,2", [0, 2]), ("1-3", [1, 2, 3]), ("3,0-1,1", [0, 1, 3]), (" 2 ", [2])]
)
def test_valid_specs(spec, ranks):
    assert parse_rank_spec(spec, 4) == ranks


@pytest.mark.parametrize(
    "spec, message",
    [
        ("4", "rank 4 outside the world: this kernel has 4 ranks (0-3)"),
        ("2-9", "ranks 4-9 outside the world"),
        ("1,7,0-5", "ranks 7, 4-5 outside the world"),
        ("a", "bad rank spec 'a'"),
        ("1,,2", "an empty item"),
        ("3-1", "descending"),
        ("-1", "bad rank spec"),
        ("1-2-3", "bad rank spec"),
    ],
)
def test_invalid_specs_state_the_world(spec, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_rank_spec(spec, 4)


@pytest.mark.parametrize(
    "spec", ["0-10000000", "0-" + "9" * 5000, ",".join(["7"] * 100_000), "0-" + "0" * 100_000 + "1"]
)
def test_huge_specs_are_refused_before_expanding(spec):
    """The bounds are checked before a range is expanded, and the message quotes a short prefix only."""
    tracemalloc.start()
    started = time.process_time()
    with pytest.raises(UsageError, match="outside the world|bad rank spec") as refused:
        parse_rank_spec(spec, 2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(str(refused.value)) < 300
    assert peak < 40 * len(spec) + 1_000_000  # a few copies of the spec itself at most, never the expanded range
    assert time.process_time() - started < 5
