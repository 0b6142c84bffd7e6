"""The Jupyter kernel provisioner ``shardbook-slurm``: a shardbook kernel on a Slurm allocation.

A kernelspec written by ``shardbook install --slurm`` names it in ``metadata.kernel_provisioner``
with the allocation in ``config.slurm``. Start: allocate (or take ``jobid``), saying in the server
log why the job is pending; write the connection file with the first node's address; start one
``srun`` step (``node.py`` on every node). Restart: a new step in the same allocation while it runs.
Shutdown: the step ends with the kernel, then ``scancel`` (not for a ``jobid`` given by the user).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from jupyter_client.provisioning import KernelProvisionerBase
from jupyter_core.paths import jupyter_runtime_dir
from traitlets import Dict

from shardbook.kernel.slurm import jobs
from shardbook.kernel.slurm.options import SlurmOptions
from shardbook.kernel.slurm.step import LeaseKeeper, free_port_on, plan_for, srun_argv, step_env

PROVISIONER_NAME = "shardbook-slurm"


class SlurmProvisioner(KernelProvisionerBase):
    slurm = Dict(config=True, help="SlurmOptions as a dict: nodes, ntasks_per_node, partition, ... (kernel.json)")

    process: subprocess.Popen | None = None
    job: jobs.JobInfo | None = None
    lease: LeaseKeeper | None = None
    _said_end = False

    @property
    def options(self) -> SlurmOptions:
        return SlurmOptions.from_dict(self.slurm)

    @property
    def has_process(self) -> bool:
        return self.process is not None

    def say(self, text: str) -> None:
        self.log.info("shardbook kernel %s: %s", self.kernel_id, text)

    async def _allocation(self) -> jobs.JobInfo:
        """The running allocation: the one this kernel already holds, the user's ``jobid``, or a new one."""
        options = self.options
        held = self.job.jobid if self.job else options.jobid
        if held:
            info = await asyncio.to_thread(jobs.job_info, held)
            if info is not None and info.running:
                self.say(f"using Slurm job {held} on {','.join(info.nodes)}")
                return info
            if options.jobid:
                raise jobs.AllocationError(f"--jobid {held}: " + (info.why() if info else "no such job"))
            self.say(f"Slurm job {held} has ended ({info.why() if info else 'gone'}): allocating anew")
        return await jobs.allocate(options, f"shardbook-{(self.kernel_id or 'kernel')[:8]}", self.say)

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        km = self.parent
        kwargs = await super().pre_launch(**kwargs)
        self.job = await self._allocation()
        self._said_end = False
        if self.lease is None:
            path = Path(jupyter_runtime_dir()) / f"shardbook-slurm-{self.kernel_id}.lease"
            self.lease = LeaseKeeper(path, self.options.lease_grace)
        plan = plan_for(
            self.job,
            self.options,
            command=["-m", "shardbook.kernel", "-f", "{connection_file}"],
            follower_command=["-m", "shardbook.rankd"],
            lease=self.lease.path,
        )
        if km.ip != plan.master_addr:  # a new allocation elsewhere: new address, new ports
            km.cleanup_connection_file()
            km.ip = plan.master_addr
            km.shell_port = km.iopub_port = km.stdin_port = km.hb_port = km.control_port = 0
        kernel_ports = ("shell_port", "iopub_port", "stdin_port", "hb_port", "control_port")
        taken = {getattr(km, name) for name in kernel_ports} - {0}
        if plan.master_port in taken:  # a restart keeps its ports: the rendezvous takes another
            plan.master_port = free_port_on(plan.master_addr, taken)
        taken.add(plan.master_port)
        for name in kernel_ports:
            if not getattr(km, name):
                setattr(km, name, free_port_on(km.ip, taken))
                taken.add(getattr(km, name))
        km.write_connection_file()
        self.connection_info = km.get_connection_info()
        kwargs["env"] = step_env({**os.environ, **kwargs["env"]}, plan, self.options, dict(self.connection_info))
        self.say(f"starting the ranks: torchrun on {plan.nnodes} nodes x {plan.nproc}, rank 0 at {plan.master_addr}")
        kwargs["cmd"] = srun_argv(plan, self.options)
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> dict:
        popen = {k: kwargs[k] for k in ("env", "cwd", "stdout", "stderr") if k in kwargs}
        self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, **popen)
        return self.connection_info

    async def poll(self) -> int | None:
        if self.process is None:
            return 0
        code = self.process.poll()
        if code is not None and code != 0 and not self._said_end and self.job is not None:
            self._said_end = True
            why = await self._end_reason(self.job.jobid)
            self.log.warning("shardbook kernel %s died (srun exit %s): %s", self.kernel_id, code, why)
        return code

    async def _end_reason(self, jobid: str, settle_s: float = 15.0) -> str:
        """Slurm's word on the job once srun has ended: its final state (after COMPLETING) and reason."""
        for _ in range(int(settle_s / 0.5)):
            info = await asyncio.to_thread(jobs.job_info, jobid)
            if info is None:
                return f"Slurm job {jobid} is gone"
            if info.running:
                return f"{info.why()}: the ranks' step failed (see the ranks' output above), the allocation remains"
            if info.state != "COMPLETING":
                return info.why()
            await asyncio.sleep(0.5)
        return info.why()

    async def wait(self) -> int | None:
        while (code := await self.poll()) is None:
            await asyncio.sleep(0.2)
        return code

    async def send_signal(self, signum: int) -> None:
        """Interrupts go as messages (``interrupt_mode: message``); other signals end the step."""
        if self.process is not None and self.process.poll() is None and signum != signal.SIGINT:
            self.process.send_signal(signal.SIGTERM)

    async def terminate(self, restart: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    async def kill(self, restart: bool = False) -> None:
        if self.job is not None:
            await asyncio.to_thread(jobs.cancel_steps, self.job.jobid)
        if self.process is not None and self.process.poll() is None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.process.wait), 10)
            except asyncio.TimeoutError:
                self.process.kill()

    async def cleanup(self, restart: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            await self.kill(restart)
        self.process = None
        if restart:
            return
        if self.lease is not None:
            self.lease.stop()
            self.lease = None
        if self.job is not None and self.options.jobid is None:
            self.say(f"giving back Slurm job {self.job.jobid} (scancel)")
            await asyncio.to_thread(jobs.cancel, self.job.jobid)
        self.job = None

    def get_shutdown_wait_time(self, recommended: float = 5.0) -> float:
        return max(recommended, 15.0)  # the followers on other nodes leave too, and srun reports the step's end

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        return max(recommended, 30.0)

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info["slurm_jobid"] = self.job.jobid if self.job else None
        return info
