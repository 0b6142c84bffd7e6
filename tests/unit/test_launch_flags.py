"""``--nproc`` and the Slurm flags after CONFIG (``shardbook serve DIR --nproc 2``, as one types a command
after the model) are taken as if given before it; before, the config overrides refused them
("override '--nproc' must name section.key")."""

from __future__ import annotations

from shardbook.kernel.cli.launcher import split_launch_flags
from shardbook.kernel.cli.main import build_parser
from shardbook.kernel.cli.serve import split_flags
from shardbook.rankd.config.parsing import parse_overrides


def test_serve_takes_launch_flags_after_config_and_keeps_those_before() -> None:
    argv = ["serve", "--sbatch-arg=--exclusive", "--pending-timeout", "100", "demo", "--nproc", "2", "--port", "8001"]
    argv += ["--slurm", "--nodes", "2", "--sbatch-arg=--mem=0", "--inference.max_new_tokens", "5"]
    args = build_parser().parse_args(argv)
    split_flags(args)
    assert (args.nproc, args.port, args.slurm, args.nodes) == (2, 8001, True, 2)
    assert args.sbatch_arg == ["--exclusive", "--mem=0"]  # repeatable: both places count
    assert args.pending_timeout == 100.0  # not reset to its default by the part after CONFIG
    assert args.overrides == ["--inference.max_new_tokens", "5"]
    parse_overrides(args.overrides)  # what is left is a config override


def test_chat_takes_nproc_after_config() -> None:
    args = build_parser().parse_args(["chat", "demo", "--nproc", "2", "--model.dtype", "float32"])
    split_launch_flags(args)
    assert (args.nproc, args.slurm, args.overrides) == (2, False, ["--model.dtype", "float32"])
