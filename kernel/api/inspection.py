"""Rank 0's API for inspecting the loaded model: trace, logit lens, full parameters, interventions, share.

Each call runs one command on every rank (rank 0 in-process) in its turn of the generation
queue, so it never interleaves with a reply being generated, and returns rank 0's value: whole
tensors on CPU, whatever the layout. A failure on any rank raises :class:`InspectionFailed`,
which carries every rank's reply.
"""

from __future__ import annotations

from typing import Any

from shardbook.kernel.ranks.failures import describe_failures
from shardbook.kernel.ranks.pool import OnNotice, OnOutput, Outcome
from shardbook.kernel.ranks.runtime import Runtime

DEFAULT_MAX_MB = 1024.0


class InspectionFailed(RuntimeError):
    """An inspection command failed on some rank; ``outcome`` has each rank's error."""

    def __init__(self, outcome: Outcome):
        super().__init__(describe_failures(outcome))
        self.outcome = outcome


def _quiet(*_args: Any) -> None:
    """Output of the ranks while a command runs (they print nothing unless something breaks)."""


class Inspector:
    """Inspection commands on every rank of ``runtime``; output and notices go to the given callbacks."""

    def __init__(self, runtime: Runtime, on_output: OnOutput = _quiet, on_notice: OnNotice = _quiet):
        self.runtime = runtime
        self.on_output, self.on_notice = on_output, on_notice

    def run(self, kind: str, args: dict[str, Any]) -> Any:
        """Run ``kind`` on every rank and return rank 0's value, or raise :class:`InspectionFailed`."""
        if self.runtime.ctx0.state.get("loaded") is None:
            raise ValueError(
                "no model is loaded yet: run `%load_sharded configs/smollm2-135m.yaml` (or your own config) first"
            )
        ranks = list(range(self.runtime.world.world_size))
        with self.runtime.generation_queue.take_turn(kind):
            outcome = self.runtime.pool.run(kind, args, ranks, self.on_output, self.on_notice)
        if not outcome.ok:
            raise InspectionFailed(outcome)
        return outcome.replies[0]["value"]

    def trace(
        self,
        prompt: str,
        modules: list[str] | None = None,
        *,
        inputs: bool = False,
        chat: bool = False,
        lens_top: int | None = None,
        max_mb: float = DEFAULT_MAX_MB,
        grad: str | None = None,
    ):
        """One forward of ``prompt``; the outputs (or inputs) of the modules matching ``modules``
        (default: every decoder layer). ``grad`` names a function ``fn(logits) -> scalar`` defined on every
        rank (``%%all``): each capture's gradient of it is then in ``trace.grads``, its value in ``trace.metric``."""
        args = {
            "grad": grad,
            "prompt": prompt,
            "modules": modules or [],
            "inputs": inputs,
            "chat": chat,
            "lens_top": lens_top,
            "max_bytes": int(max_mb * 2**20),
        }
        return self.run("trace", args)

    def trace_many(
        self,
        prompts: list[str],
        modules: list[str] | None = None,
        *,
        batch_size: int = 8,
        reduce: str | None = None,
        per_prompt: bool = False,
        project: str | None = None,
        to: str | None = None,
        inputs: bool = False,
        chat: bool = False,
        max_mb: float = DEFAULT_MAX_MB,
    ):
        """Trace many prompts in batches of ``batch_size``: a ``Traces`` (one ``Trace`` per prompt, each of its own
        length), or with ``reduce`` (mean, sum, max, var over every real token; ``per_prompt`` for one row per
        prompt) a ``Reduced``, computed on the ranks so only the reduced tensors reach rank 0. ``project`` names a
        matrix [features, k] every rank has (``%share``) applied before reducing; ``to`` is a directory where rank 0
        writes the unreduced captures, one safetensors file per batch (``load_captures`` reads them back)."""
        if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be a non-empty list of strings")
        args = {
            "prompts": list(prompts),
            "modules": modules or [],
            "batch_size": batch_size,
            "reduce": reduce,
            "per_prompt": per_prompt,
            "project": project,
            "to": to,
            "inputs": inputs,
            "chat": chat,
            "max_bytes": int(max_mb * 2**20),
        }
        return self.run("trace", args)

    def patch(
        self, clean: str, corrupt: str, modules: list[str], metric: str, *, method: str = "activation", chat=False
    ) -> dict[str, Any]:
        """Activation patching: for each module and position, the metric (a function ``fn(logits) -> scalar`` every
        rank defined in ``%%all``) on the corrupt prompt with that output taken from the clean prompt.
        ``method="attribution"`` gives its first-order estimate from one backward. A dict with ``modules``,
        ``tokens``, ``effect`` [modules, positions], ``clean_metric`` and ``corrupt_metric``."""
        args = {"clean": clean, "corrupt": corrupt, "modules": modules, "metric": metric, "method": method}
        return self.run("patch", {**args, "chat": chat})

    def logit_lens(self, prompt: str, layers: list[str] | None = None, *, top: int = 5, chat: bool = False):
        """The trace of ``layers`` (default: every decoder layer) with its ``Lens``:
        top tokens per layer and position."""
        return self.trace(prompt, layers, chat=chat, lens_top=top)

    def full_parameter(self, name: str, *, max_mb: float = DEFAULT_MAX_MB):
        """The whole parameter ``name`` as a CPU tensor on rank 0, whatever the layout."""
        return self.run("full_parameter", {"name": name, "max_bytes": int(max_mb * 2**20)})

    def intervene(self, function_name: str, modules: list[str], *, on_input: bool = False) -> list[dict[str, Any]]:
        """Apply the function every rank defines under ``function_name`` to the modules' outputs (or inputs)."""
        return self.run("intervene", {"action": "add", "name": function_name, "modules": modules, "input": on_input})

    def interventions(self) -> list[dict[str, Any]]:
        """The interventions registered now."""
        return self.run("intervene", {"action": "list"})

    def remove(self, function_name: str | None = None) -> list[dict[str, Any]]:
        """Remove one intervention (None: all); the ones left."""
        return self.run("intervene", {"action": "remove", "name": function_name})

    def share(self, name: str) -> list[str]:
        """Copy rank 0's variable ``name`` (a tensor, or a dict of tensors) into every rank's namespace."""
        from shardbook.rankd.commands.inspect import describe_shareable

        namespace = self.runtime.ctx0.shell.user_ns
        if name not in namespace:
            raise ValueError(f"rank 0 has no variable named {name!r} to share")
        entries = describe_shareable(namespace[name], name)
        return self.run("share", {"name": name, "entries": entries})
