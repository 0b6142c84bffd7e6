"""The steps of a sharded load, run locally on each rank and settled with every rank at a few sync points.

No collective runs between two sync points, so a rank whose step fails just skips its remaining
steps and waits at the next `settle`; there every rank learns of the failure and raises, and no
rank is left waiting in a collective the failed rank will never join. Two sync points per load
(after the skeleton, after the read) instead of one per step: each costs an all-gather plus the
wait for the slowest rank.

Step functions get their arguments passed, never captured in a lambda: a failed step's traceback
keeps the frames' functions alive, and a lambda's closure would keep the half-loaded model too.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

INTERRUPTED = (
    "the load was interrupted before it finished, so the new model is not loaded; "
    "load it again (%load_sharded in a notebook)"
)

# What each step does, for "rank N could not <...>" messages, and what to check when it fails.
STEP_WORDS = {
    "config": ("read the checkpoint's config and tokenizer", "check the path and the files in it"),
    "layout": ("choose the layout", "change parallel.decode, ep_size or ep_fsdp_size as the message says"),
    "skeleton": ("build the model skeleton", "check the config (and trust_remote_code for custom code)"),
    "memory": ("measure its free memory", "set parallel.decode explicitly (tp, gather or reshard)"),
    "shard": ("shard the model with FSDP2", "report this with the model's architecture"),
    "plan": ("match the checkpoint's tensors to the model", "check the checkpoint is complete"),
    "read": (
        "read its slices of the checkpoint",
        (
            "check the safetensors files are complete and readable on every node, and that each rank's shards fit "
            "in its memory (free_model, or more ranks)"
        ),
    ),
    "finalise": ("finish the model (buffers, tied weights)", "report this with the model's architecture"),
    "warm-up": ("run one short forward (gathers every layer)", "report this with the model's architecture"),
    "pack": (
        "pack its bfloat16 linear weights for oneDNN",
        "report this with the model's architecture; SHARDBOOK_PACKED_LINEAR=0 computes without packed weights",
    ),
}


class LoadInterrupted(Exception):
    """The stop event was set: this rank stopped at a safe point (between steps, tensors or layers)."""


class LoadSteps:
    """This rank's steps: `run` each in order (skipped after a failure), `settle` at each sync point.

    An interrupt only sets `stop` (rank 0's stop button reaches every rank that way); each rank
    notices it between steps and at every progress report inside one, never inside a collective,
    and every rank raises KeyboardInterrupt together at the next `settle`.
    """

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.stop = stop
        self.failed_step: str | None = None
        self.error: Exception | None = None

    @property
    def ok(self) -> bool:
        """No step has failed on this rank so far."""
        return self.error is None

    def run(self, step: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, or None once a step has failed on this rank (the failure waits for `settle`)."""
        if self.error is not None:
            return None
        try:
            self._raise_if_stopped()
            return fn(*args)
        except Exception as e:  # kept for settle: raising now would leave the other ranks waiting there
            self.failed_step, self.error = step, e
            return None

    def progress(self, report: Callable[[str, int, int], None], step: str) -> Callable[[int, int], None]:
        """A `(done, total)` callback for inside `step`: reports, then stops there if the load was interrupted."""
        return functools.partial(self._report_in_step, report, step)

    def _report_in_step(self, report: Callable[[str, int, int], None], step: str, done: int, total: int) -> None:
        report(step, done, total)
        self._raise_if_stopped()

    def _raise_if_stopped(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise LoadInterrupted(INTERRUPTED)

    def settle(self, value: Any = None) -> list[Any]:
        """Every rank's `value`; raises on every rank if a step failed on any (a collective)."""
        message = None if self.error is None else describe(self.error)
        mine = (self.failed_step, message, isinstance(self.error, LoadInterrupted), value)
        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, mine)
        failures = {rank: (step, message) for rank, (step, message, _, _) in enumerate(outcomes) if message is not None}
        if any(interrupted for _, _, interrupted, _ in outcomes):
            raise KeyboardInterrupt(INTERRUPTED)  # on every rank alike: each was interrupted, or will be
        if failures:
            self._raise(failures)
        return [value for _, _, _, value in outcomes]

    def _raise(self, failures: dict[int, tuple[str, str]]) -> None:
        """This rank's own error, or a pointer to the rank(s) that failed.

        Messages do not name the raising rank (its error reply does), so ranks failing alike read alike.
        """
        if self.error is not None:
            if isinstance(self.error, ValueError):
                raise self.error
            what, fix = STEP_WORDS[self.failed_step]
            raise ValueError(f"could not {what}: {describe(self.error)}; {fix}") from self.error
        first = min(failures)
        step, message = failures[first]
        what, fix = STEP_WORDS[step]
        raise ValueError(
            f"loading stopped because rank(s) {sorted(failures)} could not {what} (rank {first}: {message}); {fix}"
        )


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
