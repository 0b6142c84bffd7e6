"""`/v1/completions`, `/metrics` and `ChatModel.score` over the continuous batch, in a world of one rank.

The server runs in a process of its own (`batch_server_check.py`), since the runtime is process-wide.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checks import run_check
from tiny import make_tiny_llama, make_tiny_lm

pytestmark = pytest.mark.timeout(300)


def test_completions_over_the_batch(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    model = make_tiny_llama(tmp_path / "tiny", hidden_size=72, num_heads=9, num_kv_heads=3)
    # Llama 4's chunked attention: a model the batch cannot hold
    llama4 = dict(attention_chunk_size=8, num_local_experts=2, intermediate_size_mlp=64)
    chunked = make_tiny_lm(tmp_path / "chunked", family="llama4_text", **llama4)
    found = run_check(Path(__file__).with_name("batch_server_check.py"), model, chunked, timeout=280)
    assert found["echo_text"] and found["echo_first_none"]
    assert found["echo_max_diff"] < 1e-4
    assert found["echo_lengths"][:3] == [found["echo_lengths"][3]] * 3
    assert found["score_matches"] < 1e-4
    assert found["concurrent_equal_alone"]
    assert found["generate_many_equals_chat"]
    assert found["batch_chat"]  # ChatModel.chat(batch=True), as plain %%chat
    assert found["generate_file"]  # %generate's file loop
    assert found["list_prompt_n"]
    assert found["token_prompt"]
    assert found["seeded"]
    assert found["stream_equal"] and found["stream_logprobs_equal"]  # streamed logprobs (and echo) join up
    assert set(found["statuses"]) <= {200, 429} and found["answered"] >= 1
    assert found["metrics"]
    # 200 requests at once (64 in flight): each answered or refused with 429, never lost or failed
    assert set(found["burst_statuses"]) <= {200, 429} and found["burst_answered"] + found["burst_refused"] == 200
    assert found["burst_rss_growth_mib"] < 100, found["burst_rss_growth_mib"]  # memory bounded: at most 6 wait
    assert found["too_long"] == 400
    assert found["kv_budget_refuses"]  # the load's KV cache budget: a request that can never fit is a 400 up front
    assert found["chat_concurrent_equal_alone"] and found["chat_equals_single_path"]  # %serve (batched by default)
    assert found["chat_n_logprobs"] and found["chat_stream_equal"] and found["chat_stream_logprobs_equal"]
    assert found["model_changed"]  # waited across a load: 409, never answered by the other model
    assert found["refused_model_takes_turns"]  # decided per request: a model loaded after %serve may not batch
    assert found["stop_spares_the_notebook"]  # the server's stop ends its replies, not a notebook's sequence
    assert found["no_batch_equal"] and found["no_batch_refuses_n"]  # %serve --no-batch: turns, as before
    assert found["defaults_take_32"] == [200] * 32  # the default batch and line hold 32 clients at once
