"""Real clients against ``shardbook serve --nproc 2`` (one server start for all): the tiny tool model of
``tests/taught.py`` served by 2 ranks under torchrun; the openai client's tool-calling round trip, whole and
streamed, the OpenAI Agents SDK's agent and LangChain's ``bind_tools`` to their final answer, and lm-eval's
``local-chat-completions`` passing ``chat_template_kwargs`` that reach the template. The same checkpoint in the
2-rank kernel, served by ``%serve`` with each family's parser in turn: every format read from real tokens that
2 ranks generated."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tool_serve_check import MODEL, agents_sdk, langchain, read, round_trip

from tests.e2e.http_helpers import server_url
from tests.e2e.test_terminal_serve import serving_float32
from tests.taught import FAMILY_CALLS, family_question, get_weather, save_taught, tool_model
from tests.tiny import TOOLS_TEMPLATE
from tests.unit.test_lm_eval import GENERATE_TASK

pytestmark = pytest.mark.timeout(420)
THINKING_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\\n' }}",
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '(no thinking)\\n' }}{% endif %}",
)
"""The tools template, whose prompt says when a request turned thinking off (as Qwen3's writes an empty block)."""
SAY = [{"role": "user", "content": "Say hi"}]
REPLIES = {True: "Thinking on.", False: "Thinking off."}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tool model, also taught to answer "Say hi" with thinking on and off, saved once for the module."""
    assert "(no thinking)" in THINKING_TEMPLATE
    extra = tuple((SAY, {"enable_thinking": on}, reply) for on, reply in REPLIES.items())
    model, tokenizer = tool_model(THINKING_TEMPLATE, extra)
    return save_taught(tmp_path_factory.mktemp("agents") / MODEL, model, tokenizer)


@pytest.fixture(scope="module")
def served(checkpoint):
    # hermes named: with every family's tool tokens in the taught vocabulary, auto would choose deepseek_v31's
    with serving_float32(checkpoint, "--tool-call-parser", "hermes") as server:
        yield server


def test_the_openai_client_calls_the_tool_whole_and_streamed(served):
    found = round_trip(OpenAI(base_url=served.url, api_key="none", max_retries=0))
    call = [("get_weather", {"city": "Paris"})]
    assert found["whole"] == ["tool_calls", call] and found["stream"] == ["tool_calls", call], found
    assert found["answer"] == ["stop", "It is sunny in Paris."], found


def test_agent_frameworks_run_their_loop_to_the_answer(served):
    assert agents_sdk(served.url) == "It is sunny in Paris."
    call = [("get_weather", {"city": "Paris"})]
    assert langchain(served.url) == [call, call, "It is sunny in Paris."]
    assert get_weather("Paris") == "sunny"  # the tool both frameworks ran


def test_chat_template_kwargs_reach_the_template_from_the_client_and_lm_eval(served, tmp_path, monkeypatch):
    client = OpenAI(base_url=served.url, api_key="none", max_retries=0)
    ask = dict(model=MODEL, messages=SAY, temperature=0, max_tokens=16)
    on = client.chat.completions.create(**ask)
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (on.choices[0].message.content, off.choices[0].message.content) == (REPLIES[True], REPLIES[False])
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the template wrote "(no thinking)"
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    for name, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "say.jsonl"
    data.write_text(json.dumps({"question": "Say hi", "answer": REPLIES[False]}) + "\n")
    kwargs = "  chat_template_kwargs:\n    enable_thinking: false\n"
    task = GENERATE_TASK.format(name="say_thinking_off", data=data, max_gen_toks=16, more=kwargs)
    (tmp_path / "say_thinking_off.yaml").write_text(task)
    results = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"model={MODEL},base_url={served.url}/chat/completions,max_retries=1,num_concurrent=1",
        tasks=["say_thinking_off"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),  # ours only: ~20 s less
        apply_chat_template=True,
        log_samples=True,
    )
    assert results["samples"]["say_thinking_off"][0]["resps"][0][0] == REPLIES[False], results["samples"]
    assert results["results"]["say_thinking_off"]["exact_match,none"] == 1.0


def test_every_familys_call_is_read_from_two_ranks_tokens(kernel, checkpoint):
    """The checkpoint loaded in the 2-rank kernel and served by ``%serve`` with each family's tool_call_parser in
    turn (one load, a server start per family): the call each family's format writes, whole and streamed."""
    load = f"%load_sharded --model.model_name_or_path {checkpoint} --model.dtype float32 --inference.system_prompt none"
    loaded = kernel.run(load, timeout=120)
    assert loaded.status == "ok", loaded.error_text() + loaded.stderr()
    found = {}
    for name in FAMILY_CALLS:
        started = kernel.run(f"%serve --port 0 --tool-call-parser {name}")
        assert started.status == "ok", started.error_text()
        try:
            client = OpenAI(base_url=server_url(started.stdout()), api_key="none", max_retries=0)
            found[name] = read(client, family_question(name))
        finally:
            assert kernel.run("%serve --stop").status == "ok"
    call = [("get_weather", {"city": "Paris"})]
    for name, replies in found.items():
        for finish, reasoning, content, calls in replies:  # whole, then streamed
            assert (finish, calls, content or "") == ("tool_calls", call, ""), (name, found)
            assert (reasoning or "") == ("Need the weather." if name == "harmony" else ""), (name, found)
