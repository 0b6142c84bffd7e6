"""The HTTP server in this process over a fake pool: what the ranks are asked, and which model answers."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from shardbook.kernel.ranks.generation_queue import GenerationQueue
from shardbook.kernel.server.server import Server
from shardbook.kernel.server.state import ServeOptions
from shardbook.rankd.config.schema import InferenceConfig
from tests.e2e.conftest import wait_until
from tests.e2e.http_helpers import chat, request
from tests.tiny import make_tokenizer


class EchoPool:
    """Answers every generate command with "ok", recording the requests the ranks were sent."""

    def __init__(self):
        self.world = SimpleNamespace(world_size=2)
        self.requests: list[dict] = []

    def run(self, kind, args, targets, on_output, on_notice, on_start=None):
        on_start(SimpleNamespace(id="c"))
        self.requests.append(args["request"])
        on_output(0, "text", {"text": "ok"})
        value = dict(
            text="ok", prompt_tokens=3, generated_tokens=1, finish_reason="stop", time_to_first_token_s=0.0,
            tokens_per_s=0.0, seed=0, scores=None,
        )  # fmt: skip
        return SimpleNamespace(ok=True, replies={0: {"status": "ok", "value": value}}, stuck=[])

    def interrupt(self, command):
        pass

    def health(self):
        return {"can_serve": True, "loading": False, "busy": False, "dead_ranks": [], "silent_ranks": [], "ranks": []}


def model_state(name: str, system_prompt: str | None = None) -> dict:
    context = SimpleNamespace(max_position_embeddings=2048)
    loaded = SimpleNamespace(
        tokenizer=make_tokenizer(), model=SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: context))
    )
    config = SimpleNamespace(
        model=SimpleNamespace(model_name_or_path=f"/models/{name}"),
        inference=InferenceConfig(system_prompt=system_prompt),
    )
    return {"config": config, "loaded": loaded}  # fmt: skip


@pytest.fixture
def served():
    state = model_state("A", "Be brief.")
    runtime = SimpleNamespace(
        pool=EchoPool(), generation_queue=GenerationQueue(), ctx0=SimpleNamespace(state=state), server=None
    )
    server = Server(runtime, ServeOptions(port=0, batch=False)).start()  # the single-reply path (--no-batch)
    yield runtime, server.url
    server.stop()


def test_a_request_gets_the_configs_system_prompt(served):
    runtime, url = served
    assert request(url, "GET", "/health").body["status"] == "ok"
    assert chat(url, "A", "hi", max_tokens=2).status == 200
    assert runtime.pool.requests[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


def test_a_request_queued_across_a_load_is_not_answered_by_the_new_model(served):
    runtime, url = served
    load = runtime.generation_queue.enter("load")  # %load_sharded holds the ranks
    assert load.wait()
    replies = []
    waiting = threading.Thread(target=lambda: replies.append(chat(url, "A", "hi", max_tokens=2)))
    waiting.start()
    assert wait_until(lambda: runtime.generation_queue.num_waiting() == 1, timeout=10)
    runtime.ctx0.state = model_state("B")  # the load replaced model A by model B
    load.finish()
    waiting.join(10)
    reply = replies[0]
    assert (reply.status, reply.error["code"], reply.error["param"]) == (409, "model_changed", "model"), reply.body
    assert "'A'" in reply.error["message"] and "'B' is loaded now" in reply.error["message"]
    assert runtime.pool.requests == []  # the ranks never generated for it
    ok = chat(url, "B", "hi", max_tokens=2)
    assert (ok.status, ok.body["model"]) == (200, "B")
