"""One real Slurm cluster (munged, slurmctld, slurmd n1 and n2 on 127.0.0.1) for every Slurm test of the session."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from shardbook.kernel.cli.main import main
from tests.prerequisites import require
from tests.slurm.cluster import Cluster, missing


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    require(missing())  # a skip here, a failure under CI
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start(deadline_s=60)
    except RuntimeError as e:
        cluster.stop()
        pytest.fail(str(e))
    os.environ["SLURM_CONF"] = str(cluster.conf)
    yield cluster
    for line in cluster.queue():
        subprocess.run(["scancel", line.split()[0]], env=cluster.env)
    cluster.stop()
    os.environ.pop("SLURM_CONF", None)


def install_slurm_spec(prefix: Path, name: str, *extra: str) -> None:
    """``shardbook install --slurm`` in this process (a subprocess per spec costs seconds of imports)."""
    assert main(["install", "--prefix", str(prefix), "--name", name, "--slurm", *extra]) == 0


@pytest.fixture(scope="session")
def slurm_prefix(slurm_cluster, tmp_path_factory) -> Path:
    """Kernelspecs for the Slurm provisioner; the lease grace is short so that the SIGKILL test ends soon."""
    prefix = tmp_path_factory.mktemp("jupyter-slurm")
    common = ["--env", "OMP_NUM_THREADS=1", "--lease-grace", "8"]
    install_slurm_spec(prefix, "slurm2x1", "--nodes", "2", "--ntasks-per-node", "1", *common)
    install_slurm_spec(prefix, "slurm2x2", "--nodes", "2", "--ntasks-per-node", "2", *common)
    install_slurm_spec(prefix, "slurm-held", "--nodes", "1", "--ntasks-per-node", "1", "--partition", "held")
    install_slurm_spec(
        prefix, "slurm-held-short", "--nodes", "1", "--ntasks-per-node", "1", "--partition", "held",
        "--pending-timeout", "6",
    )  # fmt: skip
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
    return prefix
