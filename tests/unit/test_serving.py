"""The serving pieces without processes: OpenAI request checks, stop strings in a stream,
the generation queue, options."""

from __future__ import annotations

import json
import threading

import pytest

from shardbook.kernel.ranks.generation_queue import GenerationQueue, QueueFull
from shardbook.kernel.server.openai_api import ApiError, check_fits_context, parse_request
from shardbook.kernel.server.state import ServeOptions, is_loopback
from shardbook.rankd.generation.streaming import StopTextFilter

USER = [{"role": "user", "content": "hi"}]


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


def test_a_full_request_becomes_settings_named_as_the_engine_names_them():
    request = parse_request(
        body(
            max_completion_tokens=7,
            max_tokens=99,
            temperature=0.5,
            top_p=0.9,
            seed=3,
            stop="##",
            stream=True,
            stream_options={"include_usage": True},
            n=1,
            logprobs=False,
            user="me",
        )
    )
    assert request.settings == {"max_new_tokens": 7, "do_sample": True, "temperature": 0.5, "top_p": 0.9, "seed": 3}
    assert (request.stop, request.stream, request.include_usage) == (["##"], True, True)
    assert parse_request(body(temperature=0)).settings == {"do_sample": False}


def test_messages_keep_their_roles_and_text_parts_are_joined():
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
    ]
    assert parse_request(body(messages=messages)).messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok"},
    ]


@pytest.mark.parametrize(
    "raw, param",
    [
        (b"{not json", None),
        (b"[" * 100_000 + b"]" * 100_000, None),
        (b'{"model": "m", "messages": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}", None),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (json.dumps({"messages": USER}).encode(), "model"),
        (body(n=2), "n"),
        (body(tools=[{"type": "function"}]), "tools[0]"),
        (body(logprobs=True), "logprobs"),
        (body(frequency_penalty=0.5), "frequency_penalty"),
        (body(best_of=3), "best_of"),
        (body(max_tokens=0), "max_tokens"),
        (body(max_tokens="5"), "max_tokens"),
        (body(temperature=3), "temperature"),
        (body(temperature=1e-39), "temperature"),  # the logits would overflow
        (body(top_p=0), "top_p"),
        (body(seed=True), "seed"),
        (body(stop=["a", "b", "c", "d", "e"]), "stop"),
        (body(stop=[""]), "stop"),
        (body(stop="x" * 257), "stop"),
        (body(stop=["a", "y" * 10_000]), "stop"),
        (body(stream_options={"include_usage": True}), "stream_options"),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
        (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages[0].content"),
        (body(messages=[{"role": "user", "content": "x", "name": "bob"}]), "messages[0]"),
    ],
)
def test_each_unsupported_or_wrong_field_is_a_400_naming_it(raw, param):
    with pytest.raises(ApiError) as e:
        parse_request(raw)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error" and e.value.body()["error"]["message"]


def test_max_tokens_beyond_the_context_is_refused_naming_the_sizes():
    check_fits_context(256, 200, 56)
    with pytest.raises(ApiError) as e:
        check_fits_context(256, 200, 57)
    assert e.value.param == "max_tokens" and "256" in str(e.value) and e.value.code == "context_length_exceeded"
    with pytest.raises(ApiError) as e:
        check_fits_context(256, 300, None)
    assert e.value.param == "messages"


@pytest.mark.parametrize(
    "chunks",
    [["Hello wor", "ld. Stop", "## here"], ["Hello world. Stop#", "#", " here"], list("Hello world. Stop## here")],
)
def test_stop_strings_are_cut_exactly_however_the_text_is_split(chunks):
    sent = []
    stream = StopTextFilter(sent.append, ["##", "never"])
    for chunk in chunks:
        stream(chunk)
    stream.close()
    assert "".join(sent) == "Hello world. Stop"
    assert not any("#" in s for s in sent)


def test_text_held_back_as_a_possible_stop_is_sent_when_it_was_not_one():
    sent = []
    stream = StopTextFilter(sent.append, ["STOP"])
    for chunk in ["a S", "T", "x", " end S"]:
        stream(chunk)
    assert "".join(sent) == "a STx end "
    stream.close()
    assert "".join(sent) == "a STx end S"


def test_turns_run_one_at_a_time_in_arrival_order():
    queue = GenerationQueue()
    order, turns = [], [queue.enter(f"t{i}") for i in range(4)]

    def run(turn):
        assert turn.wait()
        order.append(turn.source)
        turn.finish()

    threads = [threading.Thread(target=run, args=(t,)) for t in reversed(turns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["t0", "t1", "t2", "t3"]


def test_a_full_line_refuses_bounded_entries_only_and_a_turn_that_left_frees_its_place():
    queue = GenerationQueue(max_waiting=2)
    first = queue.enter("http", bounded=True)
    assert first.wait()  # running: no longer waiting
    waiting = [queue.enter("http", bounded=True) for _ in range(2)]
    with pytest.raises(QueueFull) as e:
        queue.enter("http", bounded=True)
    assert e.value.retry_after_s >= 1
    queue.enter("chat")  # a %%chat cell always gets in line
    assert waiting[0].leave() and not waiting[0].wait()
    queue.enter("http", bounded=True)


def test_stop_running_reaches_only_the_running_turn():
    queue = GenerationQueue()
    stopped = []
    running, waiting = queue.enter("a"), queue.enter("b")
    running.on_stop, waiting.on_stop = (lambda: stopped.append("a")), (lambda: stopped.append("b"))
    assert not queue.stop_running()
    running.wait()
    assert queue.stop_running() and stopped == ["a"]


def test_other_addresses_than_loopback_need_an_api_key():
    ServeOptions(host="127.0.0.1").check()
    ServeOptions(host="localhost").check()
    ServeOptions(host="0.0.0.0", api_key="k" * 20).check()
    with pytest.raises(ValueError, match="without an API key.*--api-key"):
        ServeOptions(host="0.0.0.0").check()
    assert not is_loopback("0.0.0.0") and is_loopback("::1")
