"""AsyncChatStream stops the reply on every rank when its consumer leaves early, as ChatStream does."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from shardbook.kernel.api.chat import AsyncChatStream, ChatStream
from shardbook.kernel.ranks.generation_queue import GenerationQueue
from shardbook.rankd.generation.engine import GenerationRequest


class TalkingPool:
    """Streams text until interrupted, as the ranks do; records the interrupt."""

    def __init__(self):
        self.world = SimpleNamespace(world_size=2)
        self.interrupted = threading.Event()

    def run(self, kind, args, targets, on_output, on_notice, on_start=None):
        command = SimpleNamespace(id="c1")
        on_start(command)
        deadline = time.monotonic() + 10
        while not self.interrupted.is_set() and time.monotonic() < deadline:
            on_output(0, "text", {"text": "la "})
            time.sleep(0.01)
        replies = {0: {"status": "ok", "value": {}}}
        return SimpleNamespace(ok=True, replies=replies, stuck=[])

    def interrupt(self, command):
        self.interrupted.set()


def runtime() -> SimpleNamespace:
    return SimpleNamespace(pool=TalkingPool(), generation_queue=GenerationQueue(), ctx0=SimpleNamespace(state={}))


REQUEST = GenerationRequest(messages=[{"role": "user", "content": "talk"}], seed=0)


@pytest.mark.parametrize("how", ["break", "exception"])
def test_a_consumer_that_leaves_an_async_stream_early_stops_the_reply(how):
    rt = runtime()

    async def consume():
        stream = AsyncChatStream(rt, REQUEST)
        chunks = aiter(stream)
        try:
            async for _ in chunks:
                if how == "exception":
                    raise LookupError("the consumer failed")
                break
        except LookupError:
            pass
        await chunks.aclose() if how == "break" else None  # what `async with aclosing(...)` or GC does
        await asyncio.sleep(0.05)

    asyncio.run(consume())
    assert rt.pool.interrupted.wait(2), "the reply kept running on the ranks after its consumer left"


def test_the_sync_stream_does_the_same():
    rt = runtime()
    for _ in ChatStream(rt, REQUEST):
        break
    assert rt.pool.interrupted.wait(2)
