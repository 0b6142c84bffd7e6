"""``%load_sharded`` (load a checkpoint sharded over every rank) and ``%shards`` (where the shards are)."""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from shardbook.kernel.api.load import load_on_ranks, prepare_load
from shardbook.kernel.ranks.pool import PoolError
from shardbook.kernel.ranks.runtime import Runtime, get_runtime
from shardbook.magics.arguments import parse_line, split_line
from shardbook.magics.errors import raise_for_outcome
from shardbook.magics.relay import RankRelay, frontend_for
from shardbook.magics.views.progress import progress_view
from shardbook.magics.views.tables import shards_table, summary_table


def parse_load_args(magic, line: str) -> argparse.Namespace:
    """``[CONFIG] [--section.key value ...]``: argparse alone would read a leading override as an unknown flag."""
    tokens = split_line(line)
    if tokens and tokens[0].startswith("--") and tokens[0] not in ("-h", "--help"):
        return argparse.Namespace(config=None, overrides=tokens)
    return parse_line(magic, line)


def loaded_model(runtime: Runtime):
    loaded = runtime.ctx0.state.get("loaded")
    if loaded is None:
        raise UsageError(
            "no model is loaded yet: run `%load_sharded demo` (or your own config or model directory) first"
        )
    return loaded


@magics_class
class LoadMagics(Magics):
    """Load models across the ranks and inspect their shards."""

    @magic_arguments()
    @argument(
        "config",
        nargs="?",
        help="YAML config, model directory, or packaged config name (demo, qwen-8rank, glm-744b-npu); "
        "defaults apply without one",
    )
    @argument("overrides", nargs=argparse.REMAINDER, help="--section.key value pairs, e.g. --parallel.fsdp_size 2")
    @line_magic("load_sharded")
    def load_sharded(self, line: str):
        """Load a Hugging Face checkpoint sharded with FSDP2 over every rank. Example::

            %load_sharded demo --inference.max_new_tokens 64
            %load_sharded /path/to/checkpoint --parallel.decode tp

        CONFIG is a YAML file, a model directory (every setting at its default) or the short name
        of a packaged config (``demo``, ``qwen-8rank``, ``glm-744b-npu``; ``shardbook configs``
        lists them); the summary names the config used (or "no config file").

        Afterwards ``model`` and ``tokenizer`` exist in every rank's namespace (see them with
        ``%%all``), and ``%shards`` shows where each parameter's shards live. Loading again checks
        the new checkpoint on every rank first and keeps the old model when that check fails.
        """
        args = parse_load_args(self.load_sharded, line)
        try:
            runtime = get_runtime(self.shell)
            config, model_path, source = prepare_load(
                args.config, args.overrides, runtime.world.world_size, runtime.world
            )
        except (ValueError, PoolError) as e:
            raise UsageError(str(e)) from e
        progress = progress_view(self.shell, "loading")
        relay = RankRelay(frontend_for(self.shell), label_ranks=True, on_progress=lambda p: progress.update(**p))
        served = runtime.server.model_id() if runtime.server else None
        try:
            with runtime.generation_queue.take_turn("load"):  # after the reply in flight (%serve, %%chat)
                outcome = load_on_ranks(runtime.pool, config, model_path, relay, relay.notice)
        except PoolError as e:
            progress.close(ok=False)
            raise UsageError(str(e)) from e
        progress.close(ok=outcome.ok)
        raise_for_outcome(outcome)
        if runtime.server is not None:
            print(f"%serve now serves {runtime.server.model_id()} at {runtime.server.url} (was {served or 'nothing'})")
        return summary_table({**outcome.replies[0]["value"], "config_source": source.description})

    @magic_arguments()
    @argument("prefix", nargs="?", default="", help="only parameters whose name starts with this")
    @line_magic("shards")
    def shards(self, line: str):
        """Show each parameter's global shape, dtype, placement and local shape on every rank. Example::

            %shards model.layers.0.self_attn

        With ``reshard_after_forward=False`` the weights stay gathered after a reply; ``%shards``
        puts every rank back to its shards first (the next reply gathers them again).
        """
        args = parse_line(self.shards, line)
        try:
            runtime = get_runtime(self.shell)
        except PoolError as e:
            raise UsageError(str(e)) from e
        model = loaded_model(runtime).model
        relay = RankRelay(frontend_for(self.shell), label_ranks=True)
        try:  # after a reply the weights may still be gathered: back to the shards, on every rank
            outcome = runtime.pool.run("reshard", {}, list(range(runtime.world.world_size)), relay, relay.notice)
        except PoolError as e:
            raise UsageError(str(e)) from e
        raise_for_outcome(outcome)
        from shardbook.rankd.parallel.shard_table import shard_rows  # torch.distributed.tensor: imported on first use

        rows = shard_rows(model, args.prefix)
        if not rows:
            raise UsageError(f"no parameter name starts with {args.prefix!r}; try `%shards model.layers.0`")
        return shards_table(rows, runtime.world.world_size, args.prefix)
