"""What to ask Slurm for: the ``--slurm`` flags of ``shardbook install`` and ``shardbook serve``, and salloc's argv."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields

DEFAULT_PENDING_TIMEOUT_S = 600.0
"""How long an allocation may stay pending before the start fails and the request is cancelled."""
DEFAULT_LEASE_GRACE_S = 60.0
"""How long the ranks outlive their launcher (a Jupyter server that was killed) before the job ends itself."""


@dataclass
class SlurmOptions:
    nodes: int
    ntasks_per_node: int
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    gres: str | None = None
    gpus_per_node: str | None = None
    qos: str | None = None
    reservation: str | None = None
    sbatch_args: list[str] = field(default_factory=list)
    jobid: str | None = None
    device: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    pending_timeout: float = DEFAULT_PENDING_TIMEOUT_S
    lease_grace: float = DEFAULT_LEASE_GRACE_S

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ntasks_per_node < 1:
            raise ValueError("--nodes and --ntasks-per-node must be at least 1")

    def salloc_args(self) -> list[str]:
        """Everything salloc needs after ``salloc --no-shell``: one task slot per rank."""
        args = ["--nodes", str(self.nodes), "--ntasks-per-node", str(self.ntasks_per_node)]
        for flag in ("partition", "account", "time", "gres", "gpus_per_node", "qos", "reservation"):
            value = getattr(self, flag)
            if value:
                args.append(f"--{flag.replace('_', '-')}={value}")
        return [*args, *self.sbatch_args]

    def label(self) -> str:
        return f"{self.nodes} x {self.ntasks_per_node}"

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, [], {})}

    @classmethod
    def from_dict(cls, data: dict) -> SlurmOptions:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def add_slurm_flags(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """The allocation flags, shared by ``install --slurm`` and ``serve --slurm``."""
    g = parser.add_argument_group("Slurm (with --slurm)")
    g.add_argument("--slurm", action="store_true", help="allocate nodes with Slurm and start every rank there")
    g.add_argument("--nodes", type=int, help="nodes to allocate (torchrun --nnodes)")
    g.add_argument("--ntasks-per-node", type=int, help="ranks per node (torchrun --nproc_per_node)")
    g.add_argument("--partition", help="Slurm partition")
    g.add_argument("--account", help="Slurm account")
    g.add_argument("--time", help="time limit, as salloc --time (e.g. 02:00:00)")
    g.add_argument("--gres", help="generic resources, as salloc --gres (e.g. gpu:8)")
    g.add_argument("--gpus-per-node", help="as salloc --gpus-per-node")
    g.add_argument("--qos", help="quality of service")
    g.add_argument("--reservation", help="reservation name")
    g.add_argument(
        "--sbatch-arg", action="append", default=[], metavar="ARG", help="any other salloc flag (repeatable)"
    )
    g.add_argument("--jobid", help="use this running allocation; it is left running when the kernel stops")
    g.add_argument("--device", help="device type for every rank (cuda, npu, cpu); sets SHARDBOOK_DEVICE")
    g.add_argument(
        "--pending-timeout",
        type=float,
        default=DEFAULT_PENDING_TIMEOUT_S,
        help=f"seconds the allocation may stay pending (default {DEFAULT_PENDING_TIMEOUT_S:.0f})",
    )
    g.add_argument(
        "--lease-grace",
        type=float,
        default=DEFAULT_LEASE_GRACE_S,
        help=f"seconds the job outlives a launcher that was killed (default {DEFAULT_LEASE_GRACE_S:.0f})",
    )


def options_from_args(args: argparse.Namespace, env: dict[str, str]) -> SlurmOptions:
    if not (args.nodes and args.ntasks_per_node):
        raise ValueError("--slurm needs --nodes N and --ntasks-per-node G")
    return SlurmOptions(
        nodes=args.nodes,
        ntasks_per_node=args.ntasks_per_node,
        partition=args.partition,
        account=args.account,
        time=args.time,
        gres=args.gres,
        gpus_per_node=args.gpus_per_node,
        qos=args.qos,
        reservation=args.reservation,
        sbatch_args=list(args.sbatch_arg),
        jobid=args.jobid,
        device=args.device,
        env=env,
        pending_timeout=args.pending_timeout,
        lease_grace=args.lease_grace,
    )
