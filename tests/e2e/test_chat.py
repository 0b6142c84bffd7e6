"""%%chat and %chat through a real 2-rank kernel on a tiny local model, in the gather and tp layouts."""

from __future__ import annotations

import html
import json
import random
import re
import threading
import time

import pytest

from tests.driver import interrupt_when, wait_for_interrupt_replies
from tests.tiny import make_tiny_llama, never_ending

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama, its end of text suppressed: the interrupt tests stop replies sampled at temperature 2.0, which
    the random model could end by itself before the stop (the clean-clone CI saw one end after two tokens)."""
    return never_ending(make_tiny_llama(tmp_path_factory.mktemp("chat") / "llama"))


@pytest.fixture(scope="module", params=["gather", "tp"])
def layout(request) -> str:
    """The forward layout each chat test runs in: FSDP2 keeping the gathered layers, or tensor parallel.

    Module-scoped, so pytest runs the module's tests layout by layout and the model loads once per layout."""
    return request.param


@pytest.fixture(scope="module")
def loaded_once(kernel, tiny, layout):
    """The shared kernel with the tiny model loaded in ``layout`` (tests undo what they add to the model)."""
    ex = kernel.run(
        f"%load_sharded --model.model_name_or_path {tiny} --inference.system_prompt none --parallel.decode {layout}",
        timeout=120,
    )
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    return kernel


@pytest.fixture
def loaded(loaded_once):
    """The loaded kernel with the conversation forgotten and no system prompt."""
    assert loaded_once.run('%chat --reset --system ""').status == "ok"
    return loaded_once


def reply_widget_values(ex) -> list[str]:
    """Successive values of the reply HTML widget (the one whose value holds the shardbook-reply div)."""
    values = []
    for m in ex.of_type("comm_open", "comm_msg"):
        state = m["content"].get("data", {}).get("state", {})
        value = state.get("value")
        if isinstance(value, str) and "shardbook-reply" in value:
            values.append(value)
    return values


def unwrap(value: str) -> str:
    return html.unescape(value.split(">", 1)[1].rsplit("</div>", 1)[0])


def reference_reply(path, question: str, max_new_tokens: int) -> str:
    """The same greedy reply from one plain process, for comparison."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def final_outputs(ex) -> list[dict]:
    """The cell's outputs as a saved notebook keeps them: an update_display_data replaces the data of its display."""
    outputs, by_id = [], {}
    for m in ex.of_type("display_data", "update_display_data", "execute_result"):
        content = m["content"]
        display_id = (content.get("transient") or {}).get("display_id")
        if m["msg_type"] == "update_display_data":
            by_id[display_id]["data"] = content["data"]
            continue
        outputs.append({"data": content["data"]})
        if display_id:
            by_id[display_id] = outputs[-1]
    return outputs


def test_widget_grows_then_turns_into_markdown_shown_once(loaded, tiny):
    ex = loaded.run("%%chat --max-new-tokens 60\nhello there", timeout=120)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    values = [unwrap(v) for v in reply_widget_values(ex)]
    growing = [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
    assert len(growing) >= 4, f"the reply widget was updated only {len(growing)} times"
    assert all(b.startswith(a) for a, b in zip(growing, growing[1:])), "the reply text did not grow by appending"
    live = [m for m in ex.of_type("display_data") if "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
    assert live, "the reply was not shown live in a widget"
    assert not [m for m in ex.of_type("display_data") if "text/markdown" in m["content"]["data"]], (
        "the reply was shown a second time"
    )
    outputs = final_outputs(ex)
    markdown = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o["data"]]
    assert len(markdown) == 1 and markdown[0].startswith(growing[-1]), (
        "the live view did not turn into the reply as markdown"
    )
    assert not [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o["data"]], (
        "a widget is left in the saved outputs"
    )
    assert markdown[0] == reference_reply(tiny, "hello there", 60), "2-rank greedy reply differs from one process"
    [status] = [o["data"]["text/html"] for o in outputs if "tok/s" in o["data"].get("text/html", "")]
    assert "prompt tokens" in status and "generated" in status and ("length" in status or "stop" in status)


def test_widget_updates_are_rate_limited(loaded):
    ex = loaded.run("%%chat --max-new-tokens 120\ncount to one hundred", timeout=120)
    updates = [
        m
        for m in ex.of_type("comm_msg")
        if "shardbook-reply" in str(m["content"]["data"].get("state", {}).get("value", ""))
    ]
    span = updates[-1]["received_at"] - updates[0]["received_at"]
    assert len(updates) <= 25 * span + 3, f"{len(updates)} updates in {span:.2f} s"


def test_text_output_is_rate_limited_too(loaded):
    ex = loaded.run("%%chat --output text --max-new-tokens 150\ncount to one hundred", timeout=120)
    streams = [m for m in ex.of_type("stream") if m["content"]["name"] == "stdout"]
    span = streams[-1]["received_at"] - streams[0]["received_at"]
    assert len(streams) <= 25 * span + 3, f"{len(streams)} stream messages in {span:.2f} s"


def test_text_output_history_and_turns(loaded):
    first = loaded.run("%%chat --output text --max-new-tokens 12\nfirst question")
    assert first.status == "ok" and len(first.of_type("stream")) >= 2
    assert "prompt tokens" in first.stdout()
    second = loaded.run("%%chat --output text --max-new-tokens 12\nsecond question")
    history = loaded.run("%chat --history").stdout()
    assert history.index("[user] first question") < history.index("[user] second question")
    assert history.count("[assistant]") == 2
    # the second turn's prompt holds the first turn: more prompt tokens
    tokens = [int(ex.stdout().rsplit("[", 1)[1].split()[0]) for ex in (first, second)]
    assert tokens[1] > tokens[0] + 5
    # ...and reuses its kept blocks: at least the first prompt's whole 16-token blocks are not prefilled again
    cached = int(re.search(r"prompt tokens \((\d+) cached\)", second.stdout()).group(1))
    assert cached % 16 == 0 and tokens[0] // 16 * 16 <= cached < tokens[1]


def test_new_reset_system_save_load(loaded, tmp_path):
    loaded.run("%%chat --output text --max-new-tokens 5\none")
    loaded.run("%%chat --new --output text --max-new-tokens 5\ntwo")
    assert "[user] one" not in loaded.run("%chat --history").stdout()
    assert loaded.run('%chat --system "Be terse."').status == "ok"
    path = tmp_path / "conv.json"
    assert "saved 2 messages" in loaded.run(f"%chat --save {path}").stdout()
    loaded.run("%chat --reset")
    assert loaded.run("%chat --history").stdout().strip() == "[system] Be terse."
    loaded.run(f"%chat --load {path}")
    assert "[user] two" in loaded.run("%chat --history").stdout()
    bad = loaded.run(f"%chat --load {tmp_path / 'nope.json'}")
    assert bad.status == "error" and "no conversation file" in bad.stderr()


def test_save_to_an_unwritable_path_is_a_one_line_error(loaded, tmp_path):
    (tmp_path / "a-file").write_text("")
    for target in (tmp_path / "a-file" / "conv.json", tmp_path):  # under a file; a directory
        ex = loaded.run(f"%chat --save {target}")
        assert ex.status == "error"
        assert f"UsageError: could not save the conversation to {target}: " in ex.stderr(), (
            ex.error_text() + ex.stderr()
        )
        assert len(ex.stderr().strip().splitlines()) == 1 and "Traceback" not in ex.error_text() + ex.stderr()


def test_sampling_is_reproducible_with_a_seed(loaded):
    runs = [
        loaded.run("%%chat --new --do-sample --seed 7 --temperature 1.5 --output text --max-new-tokens 30\nsurprise me")
        for _ in range(2)
    ]
    texts = [ex.stdout().rsplit("\n[", 1)[0] for ex in runs]
    assert all(ex.status == "ok" for ex in runs) and texts[0] == texts[1]


def test_interrupt_keeps_partial_reply_and_next_turn_works(loaded):
    def replying(msg):
        return msg["msg_type"] == "comm_msg" and "shardbook-reply" in str(
            msg["content"]["data"].get("state", {}).get("value", "")
        )

    code = "%%chat --max-new-tokens 2000 --do-sample --temperature 2.0\nramble on"
    ex, seconds = interrupt_when(loaded, code, replying)
    assert seconds < 2.5
    assert ex.status == "ok", ex.error_text()
    assert "interrupted" in str(final_outputs(ex)[-1]["data"])
    assert "[assistant (interrupted)]" in loaded.run("%chat --history").stdout()
    assert loaded.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"].count("idle") == 2
    after = loaded.run("%%chat --output text --max-new-tokens 5\nstill there?")
    assert after.status == "ok"


def replying(msg) -> bool:
    return msg["msg_type"] == "comm_msg" and "shardbook-reply" in str(
        msg["content"]["data"].get("state", {}).get("value", "")
    )


BUSY_STEP = """%%all
import time
def busy(*_):  # a real model's step: Python code holding the GIL, so rank 0's main thread runs in fits and starts
    start = time.perf_counter()
    while time.perf_counter() - start < 0.03:
        pass
slow = model.model.layers[0].register_forward_pre_hook(busy)"""


def test_rapid_interrupts_stop_the_reply_once_and_keep_it(loaded):
    """The stop button pressed 5 times quickly, while the ranks are busy: one stop, the cell ends normally."""
    every_s = 0.02
    slow = BUSY_STEP
    assert loaded.run(slow).status == "ok"
    try:
        for trial in range(3):
            question = f"ramble on, take {trial}"
            code = f"%%chat --new --max-new-tokens 2000 --do-sample --temperature 2.0\n{question}"
            ex, _ = interrupt_when(loaded, code, replying, times=5, every_s=every_s)
            assert ex.status == "ok", f"trial {trial}: {ex.error_text()}"
            history = loaded.run("%chat --history").stdout()
            assert f"[user] {question}\n[assistant (interrupted)] " in history, f"trial {trial}: {history}"
            dist = loaded.run("%dist")
            assert dist.status == "ok", dist.error_text() + dist.stderr()
            assert dist.of_type("execute_result")[0]["content"]["data"]["text/plain"].count("idle") == 2
    finally:
        loaded.run("%%all\nslow.remove()")
    assert loaded.run("%%chat --output text --max-new-tokens 5\nstill there?").status == "ok"


INTERRUPTED_IN = """
import os, signal
from shardbook.magics.views import chat_view
original = getattr(chat_view.WidgetChatView, {where!r})
def pressed_there(self, *args):  # the stop button pressed 5 times just as the view is busy
    original(self, *args)
    for _ in range(5):
        os.kill(os.getpid(), signal.SIGINT)
setattr(chat_view.WidgetChatView, {where!r}, pressed_there)
try:
    get_ipython().run_cell_magic("chat", "--new --max-new-tokens 2000 --do-sample --temperature 2.0", {question!r})
finally:
    setattr(chat_view.WidgetChatView, {where!r}, original)
"""


@pytest.mark.parametrize("where", ["add", "finish"])
def test_an_interrupt_outside_the_wait_never_strands_the_reply(loaded, where):
    """Real SIGINTs landing while the view adds a chunk, or as it shows the finished reply: the stream still ends
    (interrupted when it was running), the reply is in the history, no rank is left busy."""
    question = f"interrupted in {where}"
    ex = loaded.run(INTERRUPTED_IN.format(where=where, question=question), timeout=60)
    assert ex.status == "ok", ex.error_text()
    history = loaded.run("%chat --history").stdout()
    assert f"[user] {question}\n[assistant" in history, history
    dist = loaded.run("%dist")
    assert dist.status == "ok", dist.error_text() + dist.stderr()
    assert dist.of_type("execute_result")[0]["content"]["data"]["text/plain"].count("idle") == 2


TAIL = """
import asyncio, threading, time
kernel = get_ipython().kernel
presses = threading.Semaphore(0)
tail_hits, hold_armed = [], threading.Event()
pressed_handlers = {{}}
for table in (kernel.shell_handlers, kernel.control_handlers):
    def counted(*args, _handler=table["interrupt_request"]):  # the stop button's handler, then a count
        async def run():
            result = _handler(*args)
            if asyncio.iscoroutine(result):
                await result
            presses.release()
        return run()
    pressed_handlers[id(table)] = table["interrupt_request"]
    table["interrupt_request"] = counted

def arm(info):  # only a %%chat cell's end is held
    if info.raw_cell.startswith("%%chat"):
        hold_armed.set()

def hold_the_cell_end():  # the end of a %%chat cell waits until the test has pressed {presses} times
    if not hold_armed.is_set():
        return
    hold_armed.clear()
    print("{mark}", flush=True)
    try:
        for _ in range({presses}):
            presses.acquire(timeout=30)
        time.sleep(0.2)  # a SIGINT the last press sent lands here (there should be none)
    except KeyboardInterrupt:
        tail_hits.append("KeyboardInterrupt at the end of the cell")

get_ipython().events.register("pre_run_cell", arm)
get_ipython().events.register("post_execute", hold_the_cell_end)
"""
UNTAIL = """
get_ipython().events.unregister("pre_run_cell", arm)
get_ipython().events.unregister("post_execute", hold_the_cell_end)
for table in (kernel.shell_handlers, kernel.control_handlers):
    table["interrupt_request"] = pressed_handlers[id(table)]
"""
TAIL_MARK = "the cell ends now"


@pytest.mark.parametrize("flags", ["", "--no-batch"])
def test_presses_after_the_turn_is_recorded_never_reach_the_cell(loaded, flags):
    """Five presses while a %%chat reply streams, then one more as the cell ends (its turn already recorded),
    on the batch and alone. Before, every press on the batch and every press after the reply became a SIGINT,
    which raised KeyboardInterrupt wherever the main thread was (a busy machine widens these windows): in the
    cell's end here, deterministically. Now the stop button stops the cell's reply directly and sends no SIGINT."""
    assert loaded.run(TAIL.format(presses=6, mark=TAIL_MARK)).status == "ok"
    try:
        reply_seen, tail_seen, result = threading.Event(), threading.Event(), {}

        def watch(msg):
            if replying(msg):
                reply_seen.set()
            if msg["msg_type"] == "stream" and TAIL_MARK in msg["content"]["text"]:
                tail_seen.set()

        question = f"pressed at the end, {flags or 'batched'}"
        code = f"%%chat {flags} --new --max-new-tokens 2000 --do-sample --temperature 2.0\n{question}"
        thread = threading.Thread(target=lambda: result.update(ex=loaded.run(code, timeout=120, on_message=watch)))
        thread.start()
        assert reply_seen.wait(60), "the reply never streamed"
        for press in range(5):
            time.sleep(0.05 if press else 0)
            loaded.km.interrupt_kernel()
        assert tail_seen.wait(60), "the cell never reached its end"
        loaded.km.interrupt_kernel()
        thread.join(120)
        wait_for_interrupt_replies(loaded.km, 6, deadline=time.monotonic() + 60)
        ex = result["ex"]
        assert ex.status == "ok", ex.error_text()
        hits = loaded.run("print(tail_hits)").stdout()
        assert hits.strip() == "[]", hits
        assert f"[user] {question}\n[assistant (interrupted)] " in loaded.run("%chat --history").stdout()
        dist = loaded.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"]
        assert dist.count("idle") == 2, dist
    finally:
        loaded.run(UNTAIL)


BATCH_MATE = """
from shardbook.kernel.api.batch import scheduler_for, sequence_request, submit
from shardbook.kernel.ranks.runtime import get_runtime
mate = submit(get_runtime(), sequence_request(get_runtime(), "count", chat=True, max_new_tokens=120, ignore_eos=True))
"""


def test_the_stop_button_stops_the_cells_reply_not_its_batch_mates(loaded):
    """A %%chat reply decoding in the batch beside another sequence (an HTTP request's, another cell's): the stop
    button stops the cell's reply only. Before, it stopped every sequence of the batch (the batch's turn)."""
    assert loaded.run(BUSY_STEP).status == "ok"
    try:
        mate = loaded.run(BATCH_MATE)
        assert mate.status == "ok", mate.error_text()
        code = "%%chat --new --max-new-tokens 2000 --do-sample --temperature 2.0\nramble on beside a batch mate"
        ex, _ = interrupt_when(loaded, code, replying)
        assert ex.status == "ok", ex.error_text()
        assert "[assistant (interrupted)]" in loaded.run("%chat --history").stdout()
        mate = loaded.run("print(mate.wait(120).finish_reason, scheduler_for(get_runtime()).driven.wait(30))")
        assert mate.stdout().split() == ["length", "True"], mate.stdout() + mate.error_text()
    finally:
        loaded.run("%%all\nslow.remove()")
    dist = loaded.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert dist.count("idle") == 2, dist


@pytest.mark.parametrize("text", ["caf\\udce9 au lait", "lone \\ud800 surrogate"])
def test_text_that_is_not_unicode_is_refused_before_any_rank_generates(loaded, tmp_path, text):
    """In a %%chat message (a frontend sends '\\ud800' escapes; surrogate-escaped bytes look alike)
    or a loaded conversation."""
    ex = loaded.run(f"get_ipython().run_cell_magic('chat', '--output text --max-new-tokens 5', '{text}')", timeout=60)
    assert ex.status == "error" and "is not valid Unicode text" in ex.stderr(), ex.error_text() + ex.stderr()
    assert "Traceback" not in ex.stderr()
    saved = tmp_path / "bad.json"
    content = text.encode().decode("unicode_escape")  # the lone surrogate itself; json.dumps writes it as an escape
    saved.write_text(json.dumps({"system_prompt": None, "turns": [{"role": "user", "content": content}]}))
    ex = loaded.run(f"%chat --load {saved}")
    assert ex.status == "error" and "turn 0 (user) is not valid Unicode text" in ex.stderr(), (
        ex.error_text() + ex.stderr()
    )
    assert loaded.run("%%chat --output text --max-new-tokens 3\nstill there?", timeout=60).status == "ok"


def test_a_rank_that_cannot_build_the_prompt_stops_every_rank_before_generating(loaded):
    """--no-batch, where every rank builds the prompt: rank 1's tokenizer refuses the conversation, no rank enters
    generate, the error names rank 1, nothing waits. The batch builds prompts on rank 0 only, so it answers."""
    refuse = (
        "%%rank 1\nsaved_template = tokenizer.chat_template\n"
        "tokenizer.chat_template = \"{{ raise_exception('rank 1 refuses this prompt') }}\""
    )
    assert loaded.run(refuse).status == "ok"
    try:
        ex = loaded.run("%%chat --no-batch --output text --max-new-tokens 5\nhello", timeout=60)
        batched = loaded.run("%%chat --output text --max-new-tokens 5\nhello", timeout=60)
    finally:
        assert loaded.run("%%rank 1\ntokenizer.chat_template = saved_template").status == "ok"
    text = ex.error_text() + ex.stderr()
    assert ex.status == "error", text
    assert "rank 1" in text and "rank 1 refuses this prompt" in text and "no rank started" in text
    assert "restart" not in text.lower(), "a refused request must not look like a broken process group"
    assert batched.status == "ok", batched.error_text() + batched.stderr()
    assert loaded.run("%%chat --output text --max-new-tokens 3\nstill there?", timeout=60).status == "ok"


def test_prompt_longer_than_the_context(loaded):
    ex = loaded.run("%%chat\n" + "word " * 400)
    assert ex.status == "error"
    assert "context" in (ex.error_text() + ex.stderr()).lower()
    assert loaded.run("%%chat --output text --max-new-tokens 3\nshort").status == "ok"


@pytest.mark.parametrize("path", ["", "--no-batch"], ids=["batch", "single"])
def test_follower_failure_during_generation_names_the_rank(fresh_kernel, tiny, layout, path):
    handle = fresh_kernel(SHARDBOOK_PG_TIMEOUT="6")
    load = f"%load_sharded --model.model_name_or_path {tiny} --parallel.decode {layout}"
    assert handle.run(load, timeout=120).status == "ok"
    hook = (
        "%%rank 1\ncalls = 0\ndef explode(module, args):\n    global calls\n    calls += 1\n"
        "    if calls == 3:\n        raise RuntimeError('rank 1 broke at step 3')\n"
        "handle = model.model.layers[0].register_forward_pre_hook(explode)"
    )
    assert handle.run(hook).status == "ok"
    ex = handle.run(f"%%chat {path} --max-new-tokens 40\nhi", timeout=120)
    text = ex.error_text() + ex.stderr()
    assert ex.status == "error"
    assert "rank 1" in text and "rank 1 broke at step 3" in text
    if layout == "gather" and not path:
        # the batch's ranks agree on every step: rank 1 failed before its forward's first collective (gather
        # keeps the layers gathered, so there is none), the step fails on every rank and the group stays usable
        assert "a batch step failed (rank(s) 1: RuntimeError: rank 1 broke at step 3)" in text
        assert handle.run("%%chat --max-new-tokens 3\nagain", timeout=120).status == "ok"
    else:
        assert "restart the kernel" in text  # rank 0 timed out in a collective: the group is unusable
    dist = handle.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert "busy" not in dist


def test_shards_after_a_reply_shows_the_shards_again(loaded, layout):
    assert loaded.run("%%chat --output text --max-new-tokens 5\nhi").status == "ok"
    table = loaded.run("%shards model.layers.0.self_attn.q_proj").of_type("execute_result")[0]["content"]["data"][
        "text/plain"
    ]
    assert ("S(0)" if layout == "gather" else "tp: rows (dim 0) over 2 rank(s)") in table and "[32, 64]" in table
    assert loaded.run("%%chat --output text --max-new-tokens 5\nagain").status == "ok"


@pytest.mark.parametrize(("flags", "grace"), [("", "3"), ("--no-batch", "0.01")])
def test_rapid_interrupts_keep_the_turn_every_time(fresh_kernel, tiny, flags, grace):
    """Eight presses 0-100 ms apart (at random, seeded) during a reply, 12 times over, on the batch and alone: every
    time the cell ends normally and the partial turn is in the history. Before, a follower that replied later than
    the interrupt grace after the stop (a busy machine, a slow step: here a grace of 0.01 s, which only the single
    reply's command has) was reported stuck, and the turn was lost (1 trial in 12); and presses became SIGINTs
    that could land in the cell's end (`test_presses_after_the_turn_is_recorded_never_reach_the_cell`)."""
    kernel = fresh_kernel(SHARDBOOK_INTERRUPT_GRACE=grace)
    load = f"%load_sharded --model.model_name_or_path {tiny} --inference.system_prompt none --parallel.decode gather"
    assert kernel.run(load, timeout=120).status == "ok"
    assert kernel.run(BUSY_STEP).status == "ok"
    spacing = random.Random(f"{flags} {grace}")
    lost = []
    for trial in range(12):
        question = f"ramble on, trial {trial}"
        code = f"%%chat {flags} --new --max-new-tokens 2000 --do-sample --temperature 2.0\n{question}"
        ex, _ = interrupt_when(kernel, code, replying, times=8, every_s=lambda: spacing.uniform(0, 0.1))
        history = kernel.run("%chat --history")
        if ex.status != "ok" or f"[user] {question}\n[assistant (interrupted)] " not in history.stdout():
            lost.append((trial, ex.status, ex.error_text(), history.stdout()))
    assert not lost, lost
    dist = kernel.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert dist.count("idle") == 2, dist
