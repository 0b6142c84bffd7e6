"""%serve when a rank is killed mid-stream: the client is told the reply failed (``finish_reason: "error"``,
an error event, ``[DONE]``), never given a reply that looks cut at max_tokens."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.http_helpers import OpenStream, finish_reason, joined_text, server_url
from tests.tiny import make_long_talker

pytestmark = pytest.mark.timeout(300)


def test_a_rank_killed_mid_stream_ends_the_stream_with_an_error_event(fresh_kernel, tmp_path):
    kernel = fresh_kernel()
    talker = make_long_talker(tmp_path / "talker")
    ex = kernel.run(f"%load_sharded --model.model_name_or_path {talker} --inference.system_prompt none", timeout=120)
    assert ex.status == "ok", ex.error_text()
    url = server_url(kernel.run("%serve --port 0").stdout())
    pids = kernel.rank_pids()
    stream = OpenStream(url, "talker", "talk", max_tokens=3000)
    chunks = [stream.next_chunk(), stream.next_chunk()]
    os.kill(pids[1], signal.SIGKILL)
    chunks += stream.read_to_end()  # up to data: [DONE], which comes after the error event
    error = chunks[-1].get("error")
    assert error is not None and error["code"] == "generation_failed", chunks[-3:]
    assert "generation failed" in error["message"] and "restarted" in error["message"], error
    replies = [c for c in chunks if "choices" in c]
    assert joined_text(replies) and finish_reason(replies) == "error", chunks[-3:]
