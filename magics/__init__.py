"""shardbook's IPython surface: ``%load_ext shardbook.magics`` (the shardbook kernel loads it itself)."""

from __future__ import annotations


def load_ipython_extension(shell) -> None:
    """Register the magics, then start the runtime (join the job, connect every follower) in a thread.

    The kernel answers its frontends meanwhile: the ``kernel_info`` banner says the ranks are still
    starting, and a magic that needs them waits for them. A start-up failure is logged and kept:
    each magic then raises it at once as a UsageError, so the kernel stays usable and the cause
    shows in the notebook rather than only in a server log (``magics/startup.py`` says where else).
    """
    from shardbook.rankd.control.startup_marks import mark

    mark("kernel app set up")
    from shardbook.kernel.ranks.runtime import begin_runtime
    from shardbook.magics.cells import RankMagics
    from shardbook.magics.chat import ChatMagics
    from shardbook.magics.errors import RankError, show_rank_error
    from shardbook.magics.generate import GenerateMagics
    from shardbook.magics.inspection import InspectionMagics
    from shardbook.magics.loading import LoadMagics
    from shardbook.magics.packed_weights import watch_cells
    from shardbook.magics.serve import ServeMagics
    from shardbook.magics.startup import report_start

    mark("magics imported")
    shell.register_magics(RankMagics)
    shell.register_magics(LoadMagics)
    shell.register_magics(ChatMagics)
    shell.register_magics(GenerateMagics)
    shell.register_magics(ServeMagics)
    shell.register_magics(InspectionMagics)
    shell.set_custom_exc((RankError,), show_rank_error)
    watch_cells(shell)
    begin_runtime(shell, report_start(shell))
