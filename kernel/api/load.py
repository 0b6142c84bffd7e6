"""The load command as rank 0 issues it: the validated config and checkpoint directory, then ``load`` on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardbook.kernel.api.fetch import resolve_model_path
from shardbook.rankd.config.parsing import load_config
from shardbook.rankd.config.schema import ShardbookConfig
from shardbook.rankd.control.world import World, load_device

if TYPE_CHECKING:  # the terminal chat's launcher checks configs without the pool's imports
    from shardbook.kernel.ranks.pool import OnNotice, OnOutput, Outcome, Pool


def prepare_load(
    config_path: str | None, overrides: list[str], world_size: int, world: World | None = None
) -> tuple[ShardbookConfig, Path]:
    """The config checked against a job of `world_size` ranks, and the resolved checkpoint directory.

    With `world` (the ranks are running) the requested device is checked against theirs too;
    `shardbook chat --nproc N` checks before any rank starts, without one. ValueError names what to fix.
    """
    config = load_config(config_path, overrides, world_size=world_size)
    if world is not None:
        load_device(config.parallel.device, world)
    return config, resolve_model_path(config.model.model_name_or_path)


def load_on_ranks(
    pool: Pool, config: ShardbookConfig, model_path: Path, on_output: OnOutput, on_notice: OnNotice
) -> Outcome:
    """Run the ``load`` command on every rank (rank 0 in-process)."""
    args: dict[str, Any] = {"config": config.to_dict(), "model_path": str(model_path)}
    return pool.run("load", args, list(range(pool.world.world_size)), on_output, on_notice)
