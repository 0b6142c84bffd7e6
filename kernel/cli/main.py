"""The ``shardbook`` command line: install, uninstall, list, configs, fetch, run, chat, serve."""

from __future__ import annotations

import argparse
import sys

from shardbook.kernel.api.configs import configs_listing
from shardbook.kernel.api.fetch import add_fetch_parser
from shardbook.kernel.cli import kernelspec
from shardbook.kernel.cli.chat import add_chat_parser
from shardbook.kernel.cli.run import add_run_parser
from shardbook.kernel.cli.serve import add_serve_parser
from shardbook.kernel.slurm.options import add_slurm_flags, options_from_args


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def run_install(args: argparse.Namespace) -> int:
    if args.slurm:
        return run_install_slurm(args)
    if args.nproc is None:
        raise ValueError("give --nproc N (ranks on this node), or --slurm --nodes N --ntasks-per-node G")
    layout = kernelspec.Layout(args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port)
    key_file = args.key_file
    if layout.nnodes > 1:
        key_file = str(kernelspec.ensure_key_file(key_file or f"~/.shardbook/{kernelspec.default_name(layout)}.key"))
    options = kernelspec.KernelSpecOptions(layout, args.display_name, parse_env(args.env), key_file)
    prefix = sys.prefix if args.sys_prefix else args.prefix
    where = kernelspec.install(options, args.name, user=args.user, prefix=prefix)
    print(f"Installed kernelspec {args.name or kernelspec.default_name(layout)} in {where}")
    if layout.nnodes > 1:
        print(
            f"On each other node (node_rank 1..{layout.nnodes - 1}), with a copy of {key_file}:\n"
            f"  python -m torch.distributed.run --nnodes {layout.nnodes} --node_rank R --nproc_per_node {layout.nproc} "
            f"--master_addr {layout.master_addr} --master_port {layout.master_port} "
            f"-m shardbook.rankd --key-file {key_file}"
        )
    return 0


def run_install_slurm(args: argparse.Namespace) -> int:
    options = options_from_args(args, parse_env(args.env))
    name = args.name or f"shardbook-slurm-{options.nodes}x{options.ntasks_per_node}"
    spec = kernelspec.slurm_kernelspec_dict(options.to_dict(), args.display_name)
    prefix = sys.prefix if args.sys_prefix else args.prefix
    where = kernelspec.install(spec, name, user=args.user, prefix=prefix)
    print(f"Installed kernelspec {name} ({spec['display_name']}) in {where}")
    print("Starting it allocates the nodes (salloc); stopping it gives them back (scancel).")
    return 0


def run_uninstall(args: argparse.Namespace) -> int:
    from jupyter_client.kernelspec import KernelSpecManager

    try:
        KernelSpecManager().remove_kernel_spec(args.name)
    except KeyError:
        print(
            f"shardbook: no kernelspec named {args.name!r}; `shardbook list` shows the installed ones", file=sys.stderr
        )
        return 1
    print(f"Removed kernelspec {args.name}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    specs = kernelspec.shardbook_specs()
    if not specs:
        print("No shardbook kernels installed; `shardbook install --nproc N` adds one.")
    for name, spec in sorted(specs.items()):
        print(f"{name}\t{spec['spec']['display_name']}\t{spec['resource_dir']}")
    return 0


def run_configs(args: argparse.Namespace) -> int:
    print(configs_listing())
    return 0


EXTRAS = {
    "gguf": "demo",
    "accelerate": "demo",
    "torch_npu": "npu",
    "pytest": "test",
    "pexpect": "test",
    "nbconvert": "test",
    "playwright": "test",
    "openai": "test",
}
"""Module -> the optional extra of pyproject.toml that installs it."""


def missing_extra(error: ImportError) -> str | None:
    """The one-line message for an ImportError of a module an extra installs, else None."""
    module = (error.name or "").split(".")[0]
    if module not in EXTRAS:
        return None
    extra = EXTRAS[module]
    return f"{module} is not installed; it comes with the {extra} extra: pip install 'shardbook[{extra}]'"


def add_install_parser(sub) -> None:
    p = sub.add_parser("install", help="register a Jupyter kernel that runs N ranks under torchrun")
    p.add_argument("--nproc", type=int, help="ranks on this node (torchrun --nproc_per_node)")
    p.add_argument("--name", help="kernelspec name (default shardbook-N)")
    p.add_argument("--display-name", help="name shown in Jupyter (default states the rank count)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for the current user")
    where.add_argument(
        "--sys-prefix", action="store_true", help="install into this Python's prefix (virtualenv, conda)"
    )
    where.add_argument("--prefix", help="install under PREFIX/share/jupyter/kernels")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (the kernel is on node 0)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (must be 0: the kernel holds rank 0)")
    p.add_argument("--master-addr", help="rendezvous host for multi-node jobs")
    p.add_argument("--master-port", type=int, help="rendezvous port for multi-node jobs")
    p.add_argument("--key-file", help="control-plane key shared with the other nodes (created if missing)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for every rank")
    add_slurm_flags(p)
    p.set_defaults(run=run_install)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardbook", description="Sharded LLMs in Jupyter: kernels, models, chat.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_install_parser(sub)
    p = sub.add_parser("uninstall", help="remove a kernelspec")
    p.add_argument("name")
    p.set_defaults(run=run_uninstall)
    p = sub.add_parser("list", help="list installed shardbook kernels")
    p.set_defaults(run=run_list)
    p = sub.add_parser("configs", help="list the packaged configs, their short names and paths (to copy one)")
    p.set_defaults(run=run_configs)
    add_fetch_parser(sub)
    add_run_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)
    return parser


VALUE_FLAGS = frozenset(
    {"--nproc", "--port", "--host", "--api-key", "--api-key-file", "--max-waiting"}
    | {"--allowed-host", "--allowed-origin"}
)
"""The flags of ``shardbook chat`` and ``shardbook serve`` that take a value."""


def split_leading_overrides(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``shardbook chat [--nproc N] --model.model_name_or_path DIR ...`` (no CONFIG): (argv up to the first
    ``--section.key``, the overrides from there); (argv, None) when a CONFIG comes first or it is another command."""
    if not argv or argv[0] not in ("chat", "serve"):
        return argv, None
    index = 1
    while index < len(argv):
        token = argv[index]
        if token in VALUE_FLAGS:
            index += 2
            continue
        if token.startswith("--") and "." in token.partition("=")[0]:
            return argv[:index], argv[index:]
        if not token.startswith("-"):
            break
        index += 1
    return argv, None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, overrides = split_leading_overrides(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    if overrides is not None:
        args.overrides = overrides + args.overrides
    try:
        return args.run(args)
    except ValueError as e:
        parser.exit(2, f"shardbook {args.command}: error: {e}\n")
    except ImportError as e:
        message = missing_extra(e)
        if message is None:
            raise
        parser.exit(2, f"shardbook {args.command}: error: {message}\n")


if __name__ == "__main__":
    sys.exit(main())
