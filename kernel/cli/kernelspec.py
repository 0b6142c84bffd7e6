"""The shardbook kernelspec: a launcher line (torchrun's job) whose rank 0 is the IPython kernel.

``"interrupt_mode": "message"`` matters: torchrun turns a SIGINT into a teardown of every worker,
so Jupyter must send interrupts as messages (ipykernel then raises KeyboardInterrupt in rank 0,
and shardbook forwards it to the followers).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from shardbook.rankd.control.protocol import KEY_FILE_ENV

DEFAULT_NAME_PREFIX = "shardbook"


@dataclass
class Layout:
    """How torchrun lays out the job: ranks on this node, and the multi-node rendezvous if any."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"--nproc must be at least 1, got {self.nproc}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}")
        if self.nnodes > 1 and self.node_rank != 0:
            raise ValueError(
                "the kernel holds rank 0, so it runs on --node-rank 0; start the other nodes with "
                "`torchrun ... -m shardbook.rankd --key-file KEYFILE`"
            )
        if self.nnodes > 1 and not (self.master_addr and self.master_port):
            raise ValueError(
                "a multi-node kernel needs --master-addr HOST and --master-port PORT (reachable from every node)"
            )

    def launcher_args(self) -> list[str]:
        """What follows ``python`` to start this node's ranks.

        One node: ``shardbook.kernel.cli.localrun``, which does torchrun's one-node job without
        importing torch (rank 0 is then the only import of torch on the start path) and picks a free
        port at each start, so kernels never collide. Several nodes: torchrun, for its rendezvous.
        """
        if self.nnodes == 1:
            return ["-m", "shardbook.kernel.cli.localrun", "--nproc", str(self.nproc)]
        return [
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(self.nnodes),
            "--node_rank",
            str(self.node_rank),
            "--nproc_per_node",
            str(self.nproc),
            "--master_addr",
            str(self.master_addr),
            "--master_port",
            str(self.master_port),
        ]


@dataclass
class KernelSpecOptions:
    layout: Layout
    display_name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    key_file: str | None = None
    python: str = sys.executable


def default_name(layout: Layout) -> str:
    suffix = f"{layout.nproc}" if layout.nnodes == 1 else f"{layout.nnodes}x{layout.nproc}"
    return f"{DEFAULT_NAME_PREFIX}-{suffix}"


def default_display_name(layout: Layout) -> str:
    total = layout.nproc * layout.nnodes
    where = f"{layout.nnodes} nodes x {layout.nproc}" if layout.nnodes > 1 else "1 node"
    return f"shardbook ({total} ranks, {where})"


def kernelspec_dict(options: KernelSpecOptions) -> dict:
    """The kernel.json content."""
    layout = options.layout
    argv = [
        options.python,
        *layout.launcher_args(),
        "-m",
        "shardbook.kernel",
        "-f",
        "{connection_file}",
    ]
    env = dict(options.env)
    if options.key_file:
        env[KEY_FILE_ENV] = str(options.key_file)
    return {
        "argv": argv,
        "display_name": options.display_name or default_display_name(layout),
        "language": "python",
        "interrupt_mode": "message",
        "env": env,
        "metadata": {
            "shardbook": {"nproc": layout.nproc, "nnodes": layout.nnodes, "world_size": layout.nproc * layout.nnodes}
        },
    }


def slurm_kernelspec_dict(slurm: dict, display_name: str | None, python: str = sys.executable) -> dict:
    """kernel.json for the ``shardbook-slurm`` provisioner: it allocates the nodes and starts every rank.

    ``argv`` is what each node's srun task runs; the provisioner builds the srun line itself.
    """
    nodes, per_node = slurm["nodes"], slurm["ntasks_per_node"]
    return {
        "argv": [python, "-m", "shardbook.kernel.slurm.node", "{connection_file}"],
        "display_name": display_name or f"shardbook (Slurm, {nodes} x {per_node})",
        "language": "python",
        "interrupt_mode": "message",
        "env": {},
        "metadata": {
            "shardbook": {"nproc": per_node, "nnodes": nodes, "world_size": nodes * per_node, "slurm": True},
            "kernel_provisioner": {"provisioner_name": "shardbook-slurm", "config": {"slurm": slurm}},
        },
    }


def ensure_key_file(path: str | os.PathLike) -> Path:
    """Create a random control-plane key (mode 0600) unless the file already holds one."""
    path = Path(path).expanduser()
    if not path.exists() or not path.read_text().strip():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


def install(options: KernelSpecOptions | dict, name: str | None, *, user: bool, prefix: str | None) -> str:
    """Write the kernelspec (options, or a ready kernel.json dict) with jupyter_client; returns its directory."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = options if isinstance(options, dict) else kernelspec_dict(options)
    name = name or default_name(options.layout)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kernel.json").write_text(json.dumps(spec, indent=2))
        return KernelSpecManager().install_kernel_spec(tmp, name, user=user, prefix=prefix)


def shardbook_specs() -> dict[str, dict]:
    """Installed kernelspecs that run shardbook, by name."""
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().get_all_specs()
    return {n: s for n, s in specs.items() if any(a.startswith("shardbook.kernel") for a in s["spec"].get("argv", []))}
