"""Every rank agrees that a command's input is valid before any rank enters the command's collectives.

A rank that fails while preparing (a prompt its tokenizer refuses, no model loaded, a request it
cannot parse) would otherwise raise while the other ranks go on into collectives it never joins,
and they would wait there until the process-group timeout. Instead every rank prepares, then one
all-gather (:func:`agree`) tells every rank whether all succeeded and built the same thing; if
not, every rank raises, and no rank has started. A rank that fails before it can prepare at all
still joins that one all-gather through :func:`refuse`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from shardbook.rankd.control.capture import exception_text

T = TypeVar("T")


class NotAgreed(ValueError):
    """Another rank could not prepare this command (or prepared something different), so no rank ran it."""


def agree(prepare: Callable[[], tuple[T, str]], what: str) -> T:
    """``prepare()``'s result once every rank's ``prepare`` succeeded with the same fingerprint (one all-gather).

    ``prepare`` returns its result and a short fingerprint of what every rank must have built
    alike (a hash of the prompt, say). ``what`` completes "rank N could not ...". On failure this
    rank raises its own exception; the ranks that succeeded raise :class:`NotAgreed` naming the
    ranks that did not.
    """
    result, fingerprint, error = None, None, None
    try:
        result, fingerprint = prepare()
    except Exception as e:  # kept until every rank has heard of it
        error = e
    mine = (None if error is None else f"{type(error).__name__}: {exception_text(error)}", fingerprint)
    outcomes = _all_gather(mine)
    if error is not None:
        raise error
    failed = {rank: message for rank, (message, _) in enumerate(outcomes) if message is not None}
    if failed:
        first = min(failed)
        raise NotAgreed(
            f"rank(s) {sorted(failed)} could not {what} (rank {first}: {failed[first]}), so no rank started; "
            "fix the input and run it again"
        )
    fingerprints = {rank: print_ for rank, (_, print_) in enumerate(outcomes)}
    if len(set(fingerprints.values())) > 1:
        raise NotAgreed(
            f"the ranks could not {what} alike (fingerprints by rank: {fingerprints}), so no rank started: every rank "
            "must run the same code on the same files (check that they see the same checkpoint and package versions)"
        )
    return result


def refuse(error: Exception, what: str) -> None:
    """Join the agreement of the ranks that could prepare (so none waits in vain), then raise ``error``."""

    def fail() -> tuple[Any, str]:
        raise error

    agree(fail, what)  # raises ``error``


def _all_gather(mine: Any) -> list[Any]:
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, mine)
    return outcomes
