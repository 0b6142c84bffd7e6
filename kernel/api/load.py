"""The load command as rank 0 issues it: the validated config and checkpoint directory, then ``load`` on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from shardbook.kernel.api.configs import ConfigSource, resolve_config
from shardbook.kernel.api.fetch import resolve_model_path
from shardbook.rankd.config.parsing import load_config
from shardbook.rankd.config.schema import ShardbookConfig
from shardbook.rankd.control.world import World, load_device, require_device_extra

if TYPE_CHECKING:  # the terminal chat's launcher checks configs without the pool's imports
    from shardbook.kernel.ranks.pool import OnNotice, OnOutput, Outcome, Pool


class PreparedLoad(NamedTuple):
    """What a load needs before any rank is asked: the checked config, the checkpoint and where the config came from."""

    config: ShardbookConfig
    model_path: Path
    source: ConfigSource


def prepare_load(
    config_arg: str | None, overrides: list[str], world_size: int, world: World | None = None
) -> PreparedLoad:
    """The config checked against a job of `world_size` ranks, the resolved checkpoint directory, and the source.

    `config_arg` is a YAML file, a model directory, a packaged config's short name (`demo`) or None
    (see `resolve_config`). With `world` (the ranks are running) the requested device is checked
    against theirs too; `shardbook chat --nproc N` checks before any rank starts, without one.
    ValueError names what to fix.
    """
    source = resolve_config(config_arg)
    config = load_config(source.path, overrides, world_size=world_size)
    require_device_extra(config.parallel.device)  # before any rank starts under `shardbook chat --nproc N`
    if world is not None:
        load_device(config.parallel.device, world)
    return PreparedLoad(config, resolve_model_path(config.model.model_name_or_path), source)


def load_on_ranks(
    pool: Pool, config: ShardbookConfig, model_path: Path, on_output: OnOutput, on_notice: OnNotice
) -> Outcome:
    """Run the ``load`` command on every rank (rank 0 in-process)."""
    args: dict[str, Any] = {"config": config.to_dict(), "model_path": str(model_path)}
    return pool.run("load", args, list(range(pool.world.world_size)), on_output, on_notice)
