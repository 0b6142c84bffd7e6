"""``shardbook serve --nproc 2`` under torchrun: the openai client, Ctrl-C and SIGTERM with a reply in flight,
the key check."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from openai import OpenAI

from tests.e2e.conftest import gone, wait_until
from tests.e2e.http_helpers import URL, OpenStream, assert_demo_model_replies, finish_reason, joined_text
from tests.tiny import make_long_talker

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def talker_config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("terminal-serve")
    model = make_long_talker(root / "talker")
    path = root / "talker.yaml"
    path.write_text(f"model:\n  model_name_or_path: {model}\ninference:\n  max_new_tokens: 16\n")
    return path


class Served:
    """``shardbook serve --nproc 2 CONFIG --port 0 ...`` started, its URL read from stderr, its processes known."""

    def __init__(self, config: Path, *extra: str):
        argv = [sys.executable, "-m", "shardbook", "serve", "--nproc", "2", str(config), "--port", "0", *extra]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stderr: list[str] = []
        found = threading.Event()
        threading.Thread(target=self._read_stderr, args=(found,), daemon=True).start()
        assert found.wait(150), f"no URL on stderr: {''.join(self.stderr)}"
        self.url = URL.search("".join(self.stderr)).group(1)
        self.pids = [self.proc.pid, *(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))]
        assert len(self.pids) == 4, self.pids  # the launcher, torchrun and 2 ranks

    def _read_stderr(self, found: threading.Event) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            if URL.search(line):
                found.set()

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        code = self.proc.wait(60)
        assert wait_until(lambda: all(gone(p) for p in self.pids), timeout=15), "a rank outlived the server"
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@contextmanager
def serving_float32(checkpoint: Path, *extra: str) -> Iterator[Served]:
    """``shardbook serve`` of ``checkpoint`` in float32 with ``extra`` flags, ended by SIGTERM afterwards."""
    config = checkpoint.parent / f"{checkpoint.name}.yaml"
    config.write_text(f"model:\n  model_name_or_path: {checkpoint}\n  dtype: float32\n")
    server = Served(config, *extra)
    yield server
    server.stop(signal.SIGTERM)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_the_reply_in_flight_and_every_rank(talker_config, sig):
    served = Served(talker_config)
    try:
        client = OpenAI(base_url=served.url, api_key="unused")
        whole = client.chat.completions.create(model="talker", messages=[{"role": "user", "content": "hi"}])
        assert whole.usage.completion_tokens == 16  # the config's max_new_tokens
        streamed = client.chat.completions.create(
            model="talker", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert joined_text([c.model_dump() for c in streamed]) == whole.choices[0].message.content
        in_flight = OpenStream(served.url, "talker", "talk", max_tokens=3000, stream_options={"include_usage": True})
        assert in_flight.next_chunk()
        assert served.stop(sig) == 0, "".join(served.stderr)
        chunks = in_flight.read_to_end()
        assert finish_reason(chunks) == "length" and chunks[-1]["usage"]["completion_tokens"] < 3000
        assert "stopped (3 requests served, 0 errors)" in "".join(served.stderr)
    finally:
        served.kill()


def test_other_addresses_without_an_api_key_are_refused_before_any_rank_starts(talker_config):
    argv = [sys.executable, "-m", "shardbook", "serve", "--nproc", "2", str(talker_config), "--host", "0.0.0.0"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "without an API key" in result.stderr and "--api-key" in result.stderr
    assert "loading" not in result.stderr


@pytest.mark.slow
def test_smollm2_served_on_two_ranks_through_the_openai_client():
    served = Served(ROOT / "configs" / "smollm2-135m.yaml", "--api-key", "sk-terminal-test")
    try:
        assert_demo_model_replies(served.url, api_key="sk-terminal-test")
        assert served.stop(signal.SIGTERM) == 0
    finally:
        served.kill()
