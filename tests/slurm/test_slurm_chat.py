"""``shardbook chat --slurm`` in a terminal (a pty): the demo model on two Slurm nodes answers, Ctrl-C stops a reply
and the chat goes on, the end of input gives the nodes back."""

from __future__ import annotations

import sys

import pexpect
import pytest

from tests.e2e.conftest import wait_until
from tests.e2e.test_terminal_chat import STATUS
from tests.slurm.cluster import job_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
QUESTION = "What is the capital of France?"


def ask(child: pexpect.spawn, question: str) -> str:
    """Send a question at the prompt; the reply (what came before its status line)."""
    child.sendline(question)
    child.expect_exact(question + "\r\n")  # the terminal's echo
    child.expect(STATUS)
    return child.before


def test_chat_on_two_slurm_nodes_ctrl_c_stops_the_reply_and_end_of_input_gives_the_nodes_back(slurm_cluster):
    argv = ["-m", "shardbook", "chat", "--slurm", "--nodes", "2", "--ntasks-per-node", "1", "--lease-grace", "8"]
    argv += ["configs/smollm2-135m.yaml", "--inference.max_new_tokens", "300"]
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    child = pexpect.spawn(sys.executable, argv, env=env, encoding="utf-8", timeout=180)
    try:
        child.expect(r"ranks in Slurm job (\d+)")
        job = child.match.group(1)
        child.expect_exact("exit leaves.")
        child.expect_exact("> ")
        assert "Paris" in ask(child, QUESTION)
        child.expect_exact("> ")
        child.sendline("Write a long story about a dragon and a knight.")  # 300 tokens, about a minute here
        child.expect_exact("a knight.\r\n")
        child.expect(r"\w+ ")  # the reply has started
        child.sendcontrol("c")
        child.expect(STATUS)
        assert child.match.group(3) == "interrupted", child.before
        assert int(child.match.group(2)) < 300
        child.expect_exact("> ")
        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        child.expect_exact("> ")
        assert "Paris" in ask(child, QUESTION)
        assert child.match.group(3) == "stop"
        child.expect_exact("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
        assert f"giving back Slurm job {job}" in child.before
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    assert wait_until(lambda: not slurm_cluster.queue(), timeout=20), slurm_cluster.queue()
    assert wait_until(lambda: not job_processes(job), timeout=20), job_processes(job)
