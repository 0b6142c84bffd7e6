"""The cell magics ``%%all`` and ``%%rank`` and the line magic ``%dist``."""

from __future__ import annotations

from argparse import ArgumentTypeError

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from shardbook.kernel.ranks.pool import PoolError, check_timeout
from shardbook.kernel.ranks.runtime import get_runtime
from shardbook.magics.arguments import parse_line
from shardbook.magics.errors import raise_for_outcome
from shardbook.magics.ranks import parse_rank_spec
from shardbook.magics.relay import RankRelay, frontend_for
from shardbook.magics.views.dist_table import DistTable
from shardbook.rankd.control.world import slurm_note


def timeout_seconds(text: str) -> float:
    """``--timeout``'s type: a positive, finite number of seconds."""
    try:
        seconds = float(text)
        check_timeout(seconds)
    except ValueError as e:
        raise ArgumentTypeError(
            f"{text!r}: give a positive number of seconds (leave --timeout out for no limit)"
        ) from e
    return seconds


def exec_options(fn):
    """Flags shared by the cell magics that run code on ranks."""
    return argument(
        "--timeout",
        type=timeout_seconds,
        default=None,
        metavar="S",
        help="interrupt the cell on every rank after S seconds (default: no limit)",
    )(fn)


@magics_class
class RankMagics(Magics):
    """Run cells on the ranks of the job and inspect them."""

    def _runtime(self):
        try:
            return get_runtime(self.shell)
        except PoolError as e:
            raise UsageError(str(e)) from e

    def run_on(self, ranks: list[int], cell: str, timeout: float | None) -> None:
        runtime = self._runtime()
        relay = RankRelay(frontend_for(self.shell), label_ranks=ranks != [0])
        try:
            outcome = runtime.pool.run("exec", {"code": cell}, ranks, relay, relay.notice, timeout_s=timeout)
        except PoolError as e:
            raise UsageError(str(e)) from e
        raise_for_outcome(outcome)

    @magic_arguments()
    @exec_options
    @cell_magic("all")
    def all_ranks(self, line: str, cell: str) -> None:
        """Run the cell on every rank; output streams live, labelled by rank.

        Rank 0 runs it in the notebook's namespace, every other rank in its own persistent
        IPython shell, so variables persist per rank between cells. Example::

            %%all
            import torch.distributed as dist
            t = torch.ones(1) * dist.get_rank()
            dist.all_reduce(t)
            print(dist.get_rank(), t.item())
        """
        args = parse_line(self.all_ranks, line)
        self.run_on(list(range(self._runtime().world.world_size)), cell, args.timeout)

    @magic_arguments()
    @argument("spec", help="ranks: 1, 0,2 or 1-3")
    @exec_options
    @cell_magic("rank")
    def some_ranks(self, line: str, cell: str) -> None:
        """Run the cell on some ranks only. Example::

        %%rank 1-3
        print(model.model.layers[0].self_attn.q_proj.weight.to_local().shape)
        """
        args = parse_line(self.some_ranks, line)
        ranks = parse_rank_spec(args.spec, self._runtime().world.world_size)
        self.run_on(ranks, cell, args.timeout)

    @magic_arguments()
    @line_magic("dist")
    def dist(self, line: str) -> DistTable:
        """Show every rank: host, pid, device, backend, state (idle/busy/dead) and memory. Example::

        %dist
        """
        parse_line(self.dist, line)
        return DistTable(self._runtime().pool.snapshot(), note=slurm_note())
