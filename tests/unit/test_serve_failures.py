"""A reply whose generation fails mid-stream says so: ``finish_reason: "error"``, then the error event OpenAI's
clients raise on, then ``[DONE]``; a whole reply that fails is a 500. On the batch, on ``--no-batch`` and on
``/v1/completions``, through the openai client. The server runs in a process of its own
(``serve_failure_check.py``), since the runtime is process-wide."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checks import run_check
from tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    pytest.importorskip("openai")
    model = make_tiny_llama(tmp_path_factory.mktemp("failing") / "tiny")
    return run_check(Path(__file__).with_name("serve_failure_check.py"), model, timeout=280)


@pytest.mark.parametrize("path", ["batch", "no_batch", "completions"])
def test_a_stream_that_fails_midway_ends_with_error_and_an_error_event(found, path):
    stream = found[f"{path}_stream"]
    assert stream["text_chunks"] >= 1, stream  # it failed mid-stream, after text was sent
    assert stream["finish_reasons"][-1:] == ["error"], stream  # never "length", as if max_tokens was reached
    raised = stream["raised"]
    assert raised is not None and raised["code"] == "generation_failed", stream  # the client raised on the event
    assert "injected failure" in raised["message"] and "send the request again" in raised["message"]


@pytest.mark.parametrize("path", ["batch", "no_batch", "completions"])
def test_a_whole_reply_that_fails_is_a_500_naming_the_cause(found, path):
    reply = found[f"{path}_whole"]
    assert (reply["status"], reply["code"]) == (500, "generation_failed"), reply
    assert "injected failure" in reply["message"]


@pytest.mark.parametrize("path", ["batch", "no_batch"])
def test_the_server_serves_on_and_counts_the_failures(found, path):
    assert found[f"{path}_then_ok"] in ("stop", "length")
    assert ", 0 errors" not in found[f"{path}_status"], found[f"{path}_status"]
