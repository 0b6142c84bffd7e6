"""``shardbook chat`` on 2 ranks under torchrun, driven through piped input and through a pty
(tiny model; SmolLM2 when slow)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import psutil
import pytest

from tests.e2e.conftest import gone, wait_until
from tests.tiny import CHATML_TEMPLATE, make_tiny_llama, make_tiny_moe, make_tiny_non_causal, never_ending

pytestmark = pytest.mark.timeout(120)

STATUS = re.compile(
    r"\[(\d+) prompt tokens(?: \(\d+ cached\))?, (\d+) generated, first token \d+ ms, [\d.]+ tok/s, (\w+)\]"
)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    """A config for a tiny random Llama, 8 greedy tokens a reply."""
    root = tmp_path_factory.mktemp("terminal-chat")
    model = make_tiny_llama(root / "tiny")
    return write_config(root / "tiny.yaml", model, max_new_tokens=8)


@pytest.fixture(scope="module")
def long_talker_config(tiny_config) -> Path:
    """The tiny model that never ends a reply by itself (end of text suppressed, a long context)."""
    model = Path(shutil.copytree(tiny_config.parent / "tiny", tiny_config.parent / "long-talker"))
    edit_json(never_ending(model) / "config.json", max_position_embeddings=4096)
    return write_config(tiny_config.parent / "long.yaml", model, max_new_tokens=1000)


def write_config(path: Path, model: Path, max_new_tokens: int) -> Path:
    path.write_text(f"model:\n  model_name_or_path: {model}\ninference:\n  max_new_tokens: {max_new_tokens}\n")
    return path


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def chat_argv(config: Path, *extra: str, nproc: int | None = 2) -> list[str]:
    return [sys.executable, "-m", "shardbook", "chat", *(["--nproc", str(nproc)] if nproc else []), str(config), *extra]


def torchrun_argv(config: Path, *extra: str) -> list[str]:
    """A bare ``torchrun -m shardbook chat`` on 2 ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        *chat_argv(config, *extra, nproc=None)[1:],
    ]


def piped_chat(argv: list[str], lines: list[str], num_descendants: int, env: dict[str, str] | None = None):
    """Run the chat on ``lines`` of piped input; (result, pids of every process it started)."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    pids = started_processes(proc.pid, count=num_descendants)
    stdout, stderr = proc.communicate("".join(f"{line}\n" for line in lines), timeout=90)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), pids


def started_processes(pid: int, count: int) -> list[int]:
    """The launcher's descendants (torchrun and its ranks), once ``count`` of them are running."""
    if not count:
        return [pid]
    parent = psutil.Process(pid)
    found = wait_until(
        lambda: len(parent.children(recursive=True)) >= count and parent.children(recursive=True), timeout=60
    )
    return [pid, *(p.pid for p in found or [])]


def assert_all_gone(pids: list[int]) -> None:
    assert wait_until(lambda: all(gone(p) for p in pids), timeout=15), (
        f"processes {[p for p in pids if not gone(p)]} outlived the chat"
    )


@pytest.mark.parametrize("layout", ["auto", "tp"])
def test_piped_questions_are_answered_in_turn_and_exit_stops_every_rank(tiny_config, layout):
    argv = chat_argv(tiny_config, "--parallel.decode", layout)
    result, pids = piped_chat(argv, ["Hello there", "What is the capital of France?", "exit", "never read"], 3)
    assert result.returncode == 0, result.stderr
    assert len(pids) == 4  # the launcher, torchrun and 2 ranks
    statuses = STATUS.findall(result.stderr)
    assert [generated for _, generated, _ in statuses] == ["8", "8"]
    assert int(statuses[1][0]) > int(statuses[0][0]) + 8, "the second question was sent without the first turn"
    assert result.stdout.strip(), "no reply on stdout"
    assert "loading " in result.stderr and "on 2 rank(s) in" in result.stderr
    assert f"decode layout {'gather' if layout == 'auto' else 'tp'}." in result.stderr
    assert_all_gone(pids)


def test_commands_reset_and_system_and_end_of_input_ends_the_chat(tiny_config, tmp_path):
    """Under a bare torchrun, without a key in the environment: rank 0 hands the followers a key file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDBOOK_KEY")} | {"TMPDIR": str(tmp_path)}
    lines = ["hi", "hi", "/reset", "hi", "/system Answer in French.", "hi", "/history", "/nonsense"]
    result, pids = piped_chat(torchrun_argv(tiny_config), lines, 2, env)  # no exit: the input just ends
    assert result.returncode == 0, result.stderr
    first, second, after_reset, with_system = (int(p) for p, _, _ in STATUS.findall(result.stderr))
    assert second > first and after_reset == first, "/reset did not clear the history"
    assert with_system > first, "/system did not reach the prompt"
    assert "(conversation cleared)" in result.stderr and "(system prompt set: Answer in French.)" in result.stderr
    assert "[system] Answer in French.\n[user] hi\n[assistant] " in result.stderr
    assert "unknown command /nonsense; the commands are:\n/reset" in result.stderr
    assert not list(tmp_path.glob("shardbook-chat-*.key")), "rank 0 left its key file behind"
    assert_all_gone(pids)


def test_ctrl_c_stops_the_reply_on_every_rank_and_the_chat_goes_on(long_talker_config):
    argv = chat_argv(long_talker_config, "--inference.do_sample")
    child = pexpect.spawn(argv[0], argv[1:], encoding="utf-8", timeout=60)
    try:
        child.expect("exit leaves.")
        pids = started_processes(child.pid, count=3)
        child.expect_exact("> ")
        child.send("half a question\x03")  # Ctrl-C at the prompt drops the line
        child.expect_exact("> ")
        child.sendline("Tell me a long story")
        child.expect_exact("Tell me a long story\r\n")
        child.expect(".")  # the reply has started
        child.sendcontrol("c")
        child.expect(STATUS)
        assert child.match.group(3) == "interrupted" and int(child.match.group(2)) < 1000
        child.expect_exact("> ")
        child.sendline("And another one")
        child.expect(STATUS)
        assert child.match.group(2, 3) == ("1000", "length")
        child.expect_exact("> ")
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    assert_all_gone(pids)


def test_a_question_longer_than_a_step_and_a_prefill_chunk_is_answered(long_talker_config):
    """The terminal chat takes the single-reply path: a question of ~1,500 tokens (over `max_step_tokens` 16 and
    the 512-token chunks that path prefills in, `engine.PREFILL_CHUNK`) gets its reply, not a refusal."""
    question = " ".join(["The quick brown fox jumps over the lazy dog while the cat sleeps."] * 42)
    argv = chat_argv(long_talker_config, "--inference.max_new_tokens", "4", "--inference.max_step_tokens", "16")
    result, pids = piped_chat(argv, [question, "exit"], 3)
    assert result.returncode == 0, result.stderr
    [(prompt_tokens, generated, reason)] = STATUS.findall(result.stderr)
    assert int(prompt_tokens) > 1500 and (generated, reason) == ("4", "length"), result.stderr
    assert_all_gone(pids)


@pytest.mark.parametrize("launcher", ["shardbook chat --nproc 2", "torchrun"])
def test_unknown_config_key_exits_nonzero_on_every_rank_naming_it(tiny_config, launcher):
    """The launcher checks the config before starting torchrun; under a bare torchrun every rank checks it."""
    extra = ["--inference.max_new_tokenz", "3"]
    argv = torchrun_argv(tiny_config, *extra) if launcher == "torchrun" else chat_argv(tiny_config, *extra)
    start = time.monotonic()
    result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert result.returncode == (1 if launcher == "torchrun" else 2), result.stderr  # torchrun: 1 when a rank failed
    assert result.stderr.count("shardbook chat: error: unknown key 'inference.max_new_tokenz'") == 1
    assert "did you mean 'inference.max_new_tokens'?" in result.stderr
    assert time.monotonic() - start < 40, "a rank waited instead of failing at once"


SLOW_RANK0 = """
import os, runpy, sys, time
if os.environ["RANK"] == "0":
    time.sleep(3)  # rank 0 reaches the bad key after the follower has
sys.argv = ["shardbook", "chat", *sys.argv[1:]]
runpy.run_module("shardbook", run_name="__main__")
"""


def test_a_follower_that_finds_a_bad_key_first_leaves_rank_0_the_time_to_name_it(tiny_config, tmp_path):
    """Under a bare torchrun, torchrun stops every rank as soon as one exits: a follower that failed first used to
    exit at once and rank 0 was stopped before it printed the cause (the message was lost, nothing said why)."""
    script = tmp_path / "slow_rank0.py"
    script.write_text(SLOW_RANK0)
    argv = [*torchrun_argv(tiny_config, "--inference.max_new_tokenz", "3")]
    argv[argv.index("-m", 2) : argv.index("chat") + 1] = [str(script)]
    result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("shardbook chat: error: unknown key 'inference.max_new_tokenz'") == 1, result.stderr


def test_a_model_that_fails_to_load_ends_every_rank(tiny_config, tmp_path):
    encoder = make_tiny_non_causal(tmp_path / "bert")
    result, pids = piped_chat(chat_argv(tiny_config, "--model.model_name_or_path", str(encoder)), ["never answered"], 3)
    assert result.returncode == 1, result.stderr
    assert "shardbook chat: error: loading failed: ranks 0, 1: ValueError: " in result.stderr
    assert "not a causal language model" in result.stderr
    assert result.stderr.count("loading failed") == 1, result.stderr  # said once,
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr  # no torchrun traceback
    assert result.stdout == ""
    assert_all_gone(pids)


def test_a_template_that_refuses_a_question_is_an_error_and_the_chat_goes_on(tiny_config, tmp_path):
    """``model.chat_template`` names a template that raises on one question: that turn is one error line naming
    the template, nothing is generated for it, and the next question is answered."""
    template = tmp_path / "refusing.jinja"
    refuse = "{% for m in messages %}{% if m['content'] == 'refuse me' %}{{ raise_exception('I refuse') }}{% endif %}"
    template.write_text(refuse + "{% endfor %}" + CHATML_TEMPLATE)
    argv = chat_argv(tiny_config, "--model.chat_template", str(template))
    result, pids = piped_chat(argv, ["refuse me", "hi", "exit"], 3)
    assert result.returncode == 0, result.stderr
    assert "chat template cannot render this conversation" in result.stderr and "I refuse" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    generated = [count for _, count, _ in STATUS.findall(result.stderr)]
    assert generated == ["8"], f"the refused question was answered, or the next one was not: {generated}"
    assert_all_gone(pids)


def test_input_that_is_not_utf8_is_read_with_replacement_characters(tiny_config):
    """A Latin-1 line and random bytes on stdin: each is answered (bytes read as U+FFFD, with a notice),
    no rank hangs."""
    noise = (
        bytes(random.Random(11).randrange(128, 256) for _ in range(24)) + b"\x00\x01 \xc3"
    )  # short: the tiny context
    lines = [b"caf\xe9 au lait", noise, b"/system \xff\xfe be brief", b"still there?"]
    proc = subprocess.Popen(
        chat_argv(tiny_config), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    pids = started_processes(proc.pid, count=3)
    try:
        stdout, stderr = proc.communicate(b"\n".join(lines) + b"\nexit\n", timeout=90)
    finally:
        for pid in pids:  # a wedged chat must not outlive the test
            if not gone(pid):
                os.kill(pid, 9)
    stderr = stderr.decode("utf-8")  # everything shardbook writes is UTF-8, the replaced bytes included
    assert proc.returncode == 0, stderr
    assert len(STATUS.findall(stderr)) == 3, stderr
    assert stderr.count("is not valid UTF-8") == 3 and "byte(s) read as U+FFFD" in stderr
    assert "(system prompt set: \ufffd\ufffd be brief)" in stderr
    assert stdout.decode("utf-8").strip()
    assert_all_gone(pids)


def test_a_mixture_of_experts_model_chats_with_expert_parallelism(tmp_path):
    model = make_tiny_moe(tmp_path / "moe", "glm4_moe")
    config = write_config(tmp_path / "moe.yaml", model, max_new_tokens=6)
    result, pids = piped_chat(chat_argv(config, "--parallel.ep_size", "2"), ["hello", "exit"], 3)
    assert result.returncode == 0, result.stderr
    assert "decode layout tp." in result.stderr and len(STATUS.findall(result.stderr)) == 1
    assert_all_gone(pids)


def test_without_nproc_the_chat_is_one_rank_in_this_process(tiny_config):
    result, _ = piped_chat(chat_argv(tiny_config, nproc=None), ["hi", "quit"], 0)
    assert result.returncode == 0, result.stderr
    assert "on 1 rank(s) in" in result.stderr and len(STATUS.findall(result.stderr)) == 1


@pytest.mark.slow
def test_smollm2_on_two_ranks_knows_the_capital_of_france():
    config = Path(__file__).resolve().parents[2] / "configs" / "smollm2-135m.yaml"
    result, pids = piped_chat(
        chat_argv(config, "--inference.max_new_tokens", "24"), ["What is the capital of France?"], 3
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert_all_gone(pids)
