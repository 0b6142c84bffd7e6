"""``shardbook install --slurm``: the kernelspec names the provisioner with the allocation; salloc's and srun's argv."""

from __future__ import annotations

import json

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.provisioning.factory import KernelProvisionerFactory

from shardbook.kernel.cli.main import main
from shardbook.kernel.slurm.jobs import JobInfo
from shardbook.kernel.slurm.options import SlurmOptions
from shardbook.kernel.slurm.step import StepPlan, srun_argv, step_env
from shardbook.magics.views.dist_table import DistTable


def test_install_slurm_writes_a_provisioner_kernelspec(tmp_path, monkeypatch, capsys):
    args = ["install", "--prefix", str(tmp_path), "--slurm", "--nodes", "2", "--ntasks-per-node", "16"]
    args += ["--partition", "gpu", "--account", "proj", "--time", "01:00:00", "--gpus-per-node", "16", "--qos", "hi"]
    args += ["--reservation", "r1", "--sbatch-arg=--exclusive", "--sbatch-arg=--constraint=a100"]
    args += ["--env", "NCCL_DEBUG=INFO", "--device", "cuda"]
    assert main(args) == 0
    spec = json.loads((tmp_path / "share/jupyter/kernels/shardbook-slurm-2x16/kernel.json").read_text())
    assert spec["display_name"] == "shardbook (Slurm, 2 x 16)"
    assert spec["interrupt_mode"] == "message"
    provisioner = spec["metadata"]["kernel_provisioner"]
    assert provisioner["provisioner_name"] == "shardbook-slurm"
    options = SlurmOptions.from_dict(provisioner["config"]["slurm"])
    assert options.salloc_args() == [
        *("--nodes", "2", "--ntasks-per-node", "16", "--partition=gpu", "--account=proj", "--time=01:00:00"),
        *("--gpus-per-node=16", "--qos=hi", "--reservation=r1", "--exclusive", "--constraint=a100"),
    ]
    assert options.env == {"NCCL_DEBUG": "INFO"} and options.device == "cuda" and options.jobid is None
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share/jupyter"))
    ksm_spec = KernelSpecManager().get_kernel_spec("shardbook-slurm-2x16")
    assert KernelProvisionerFactory.instance().is_provisioner_available(ksm_spec)


def test_slurm_install_needs_nodes_and_tasks(tmp_path, capsys):
    try:
        main(["install", "--prefix", str(tmp_path), "--slurm", "--nodes", "2"])
    except SystemExit as e:
        assert e.code == 2
    assert "--slurm needs --nodes N and --ntasks-per-node G" in capsys.readouterr().err


def test_the_key_and_the_connection_reach_the_nodes_through_the_environment_only():
    options = SlurmOptions(nodes=2, ntasks_per_node=4, gres="gpu:4", env={"A": "1"})
    plan = StepPlan(
        "7", 2, 4, "10.0.0.1", 29500, ["-m", "shardbook.kernel", "-f", "{connection_file}"], [], None, 60, True
    )
    argv = srun_argv(plan, options)
    assert argv[:7] == [
        "srun",
        "--jobid=7",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",
        "--gres=gpu:4",
    ]
    env = step_env({"SLURM_JOB_ID": "3", "SLURM_CONF": "/c", "SHARDBOOK_KEY_FILE": "/k"}, plan, options, {"key": b"s"})
    assert "SLURM_JOB_ID" not in env and env["SLURM_CONF"] == "/c" and "SHARDBOOK_KEY_FILE" not in env
    assert len(env["SHARDBOOK_KEY"]) == 64 and env["A"] == "1"
    assert json.loads(env["SHARDBOOK_SLURM_CONNECTION"]) == {"key": "s"}
    assert not any(env["SHARDBOOK_KEY"] in arg or "key" in arg for arg in argv)


def test_the_chat_step_passes_input_to_node_0_alone_and_output_unbuffered():
    options = SlurmOptions(nodes=2, ntasks_per_node=1)
    plan = StepPlan("7", 2, 1, "10.0.0.1", 29500, ["-m", "shardbook", "chat"], [], None, 60, True)
    assert "--input=0" in srun_argv(plan, options, interactive=True)
    assert "--unbuffered" in srun_argv(plan, options, interactive=True)
    assert "--input=0" not in srun_argv(plan, options)


def test_the_queue_note_says_how_long_the_job_waited_and_why():
    job = JobInfo("4711", "RUNNING", "None", nodes=["n1", "n2"], pending_reasons=["Priority", "Resources"])
    job.waited_s = 130.4
    assert job.queue_note() == "waited 2 min 10 s in Slurm's queue (Priority, then Resources); Slurm job 4711 on n1,n2"
    assert JobInfo("5", "RUNNING", "None", nodes=["n1"]).queue_note() == "Slurm job 5 on n1"
    table = DistTable([], note="Slurm job 5 on n1")
    assert repr(table).endswith("\n\nSlurm job 5 on n1") and "<p>Slurm job 5 on n1</p>" in table._repr_html_()


def test_a_port_handed_out_already_is_never_handed_out_again() -> None:
    """The rendezvous port and the kernel's five are chosen one after another before any is bound: a port
    already taken must not come back (the clean-clone CI once saw the rendezvous store on the kernel's stdin
    port). An address that is not this machine's draws from torch's range: all of it taken but one port."""
    from shardbook.kernel.slurm.step import free_port_on

    taken = set(range(29500, 40000)) - {31337}
    assert free_port_on("203.0.113.7", taken) == 31337
    local = free_port_on("127.0.0.1")
    assert free_port_on("127.0.0.1", {local}) != local
