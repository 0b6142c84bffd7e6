"""Loading a model on every rank from rank 0: config, checkpoint path, then the ``load`` command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardbook.rankd.config import ShardbookConfig, load_config, validate_for_world
from shardbook.rankd.world import World, load_device

from .fetch import resolve_model_path
from .pool import OnNotice, OnOutput, Outcome, Pool


def prepare_load(config_path: str | None, overrides: list[str], world: World) -> tuple[ShardbookConfig, Path]:
    """The validated config and the resolved checkpoint directory; ValueError names what to fix."""
    config = load_config(config_path, overrides, world_size=world.world_size)
    validate_for_world(config, world.world_size)
    load_device(config.parallel.device, world)
    return config, resolve_model_path(config.model.model_name_or_path)


def load_on_ranks(pool: Pool, config: ShardbookConfig, model_path: Path, on_output: OnOutput, on_notice: OnNotice) -> Outcome:
    """Run the ``load`` command on every rank (rank 0 in-process)."""
    args: dict[str, Any] = {"config": config.to_dict(), "model_path": str(model_path)}
    return pool.run("load", args, list(range(pool.world.world_size)), on_output, on_notice)
