"""The notebook's tool loop on 2 ranks: `%%chat --tools` with a tiny model taught to call hermes-format tools.

Taught replies: "Add 2 and 3, then halve it." -> a call of add(2, 3); with add's result -> a call of halve(5);
with halve's result -> the answer, or, when halve raised, a sentence saying so. The test's chat template renders
the tools, the assistant's calls and the tools' results, so each step's prompt holds the steps before it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from notebooks.make_notebooks import TOOL_FUNCTIONS
from tests.driver import interrupt_when
from tests.taught import THINK_TAGS, rendered, save_taught, tag_tokenizer, teach

pytestmark = pytest.mark.timeout(300)

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "Add 2 and 3, then halve it."
RAISED = "error: ValueError: no halves today"
TOOLS_CODE = (
    TOOL_FUNCTIONS
    + '''
import json
import time

def halve_raising(x: float) -> float:
    """Half of a number.

    Args:
        x: the number
    """
    raise ValueError("no halves today")

def halve_slowly(x: float) -> float:
    """Half of a number.

    Args:
        x: the number
    """
    print("TOOL-STARTED", flush=True)
    time.sleep(120)
    return x / 2

halve_raising.__name__ = halve_slowly.__name__ = "halve"
raising_tools, slow_tools = [add, halve_raising], [add, halve_slowly]
'''
)
"""The notebook's tools (``add``, ``halve``, the list ``tools``), and a ``halve`` that raises and one that sleeps."""


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def taught_examples(tokenizer) -> list[tuple[list[int], str]]:
    """(prompt ids, reply) for each step of the loop, built with the template as the kernel builds them."""
    tools = [{"type": "function", "function": {"name": name}} for name in ("add", "halve")]
    calls = [("add", {"a": 2, "b": 3}, "5"), ("halve", {"x": 5}, "2.5")]
    messages = [{"role": "user", "content": QUESTION}]
    examples = []
    for name, arguments, result in calls:
        examples.append((messages, call_text(name, arguments)))
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        messages = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
        if name == "halve":
            examples.append(([*messages, {"role": "tool", "content": RAISED}], "Halving failed."))
        messages = [*messages, {"role": "tool", "content": result}]
    examples.append((messages, "It is 2.5."))
    return rendered(tokenizer, [(m, {"tools": tools}, reply) for m, reply in examples])


def make_tool_model(path: Path) -> Path:
    """The tiny Llama taught the loop's replies, saved at `path` (also run by notebooks/tools.ipynb's test)."""
    tokenizer = tag_tokenizer([*THINK_TAGS, "<tool_call>", "</tool_call>"], TOOL_TEMPLATE)
    model = teach(tokenizer, taught_examples(tokenizer), max_steps=600)
    return save_taught(path, model, tokenizer)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    return make_tool_model(tmp_path_factory.mktemp("tools") / "llama")


@pytest.fixture(scope="module")
def loaded(kernel, tool_model):
    load = f"%load_sharded --model.model_name_or_path {tool_model} --inference.system_prompt none"
    ex = kernel.run(load, timeout=120)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    assert kernel.run('%chat --reset --system "" --clear-template-args').status == "ok"
    assert kernel.run(TOOLS_CODE).status == "ok"
    return kernel


def steps(kernel) -> list:
    ex = kernel.run("print(json.dumps([[s.name, s.arguments, s.result, s.failed] for s in _chat.steps]))")
    assert ex.status == "ok", ex.error_text()
    return json.loads(ex.stdout())


def shown_steps(ex) -> list[str]:
    """The plain text of each tool call the cell displayed."""
    data = [m["content"]["data"] for m in ex.of_type("display_data")]
    return [d["text/plain"] for d in data if d.get("text/plain", "").startswith("[tool] ")]


def test_two_tool_calls_then_an_answer_and_a_step_traced(loaded):
    ex = loaded.run(f"%%chat --new --tools tools --max-new-tokens 64\n{QUESTION}", timeout=120)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    assert loaded.run("print(_chat.text, _chat.finish_reason)").stdout().strip() == "It is 2.5. stop"
    assert steps(loaded) == [["add", {"a": 2, "b": 3}, "5", False], ["halve", {"x": 5}, "2.5", False]]
    assert shown_steps(ex) == ['[tool] add({"a": 2, "b": 3}) -> 5', '[tool] halve({"x": 5}) -> 2.5']
    history = loaded.run("%chat --history").stdout()
    assert '[assistant calls] add({"a": 2, "b": 3})\n[tool add] 5\n' in history and history.endswith(
        "[assistant] It is 2.5.\n"
    )
    # a step is an ordinary prompt: traced, the model's next token there is the call it made
    traced = loaded.run(
        "step_prompts = [s.prompt for s in _chat.steps]\n"
        "traces = %trace --prompts step_prompts --modules model.layers.1\n"
        "print([tokenizer.decode([int(t.logits[-1].argmax())]) for t in traces])"
    )
    assert traced.status == "ok", traced.error_text() + traced.stderr()
    assert traced.stdout().strip() == "['<tool_call>', '<tool_call>']"


def test_an_intervention_reaches_the_loops_steps(loaded):
    """A step is an ordinary prompt under interventions too: one that bans the call token on every rank changes
    a traced step's logits there, and a loop run under it calls nothing; cleared, the loop calls again."""
    ran = loaded.run(f"%%chat --new --tools tools --output text --max-new-tokens 64\n{QUESTION}", timeout=120)
    assert ran.status == "ok" and len(steps(loaded)) == 2, ran.error_text() + ran.stderr()
    ban = (
        "%%all\n"
        "CALL_ID = tokenizer.convert_tokens_to_ids('<tool_call>')\n"
        "def no_calls(output, module_name):\n"
        "    output = output.clone()\n"
        "    output[..., CALL_ID] = -1e4\n"
        "    return output\n"
    )
    assert loaded.run(ban).status == "ok"
    trace = (
        "step_prompts = [s.prompt for s in _chat.steps]\n"
        "traces = %trace --prompts step_prompts --modules model.layers.1\n"
        "print(json.dumps([[tokenizer.decode([int(t.logits[-1].argmax())]), float(t.logits[-1, CALL_ID])] "
        "for t in traces]))"
    )
    clean = loaded.run(trace)
    assert clean.status == "ok", clean.error_text() + clean.stderr()
    assert [token for token, _ in json.loads(clean.stdout())] == ["<tool_call>", "<tool_call>"]
    try:
        assert loaded.run("%intervene no_calls lm_head --quiet").status == "ok"
        banned = loaded.run(trace)
        assert banned.status == "ok", banned.error_text() + banned.stderr()
        for token, logit in json.loads(banned.stdout()):
            assert token != "<tool_call>" and logit == -1e4, banned.stdout()
        under = loaded.run(f"%%chat --new --tools tools --output text --max-new-tokens 16\n{QUESTION}", timeout=120)
        assert under.status == "ok", under.error_text() + under.stderr()
        assert steps(loaded) == [] and not shown_steps(under)
    finally:
        assert loaded.run("%intervene --clear").status == "ok"


def test_a_step_patched(loaded):
    """%patch on a step's prompt against the same prompt with another tool result, the metric the call token's
    logits summed over positions: the last layer patched at a position changes that position's logits only, so
    its effects add up to the clean metric, and before the result it has none."""
    ran = loaded.run(f"%%chat --new --tools tools --output text --max-new-tokens 64\n{QUESTION}", timeout=120)
    assert ran.status == "ok" and len(steps(loaded)) == 2, ran.error_text() + ran.stderr()
    metric = (
        "%%all\ndef call_logits(logits):\n"
        "    return logits[0, :, tokenizer.convert_tokens_to_ids('<tool_call>')].sum()\n"
    )
    assert loaded.run(metric).status == "ok"
    patch = loaded.run(
        "clean = _chat.steps[1].prompt\n"
        "corrupt = clean.replace('tool\\n5<|im_end|>', 'tool\\n7<|im_end|>')\n"
        "assert corrupt != clean\n"
        "%patch --clean clean --corrupt corrupt --modules model.layers.* --metric call_logits\n"
        "r = _patch.result\n"
        "last = r['effect'][r['modules'].index('model.layers.1')] - r['corrupt_metric']\n"
        "print(json.dumps([float(r['clean_metric'] - r['corrupt_metric']), float(last.sum()), float(last[0])]))"
    )
    assert patch.status == "ok", patch.error_text() + patch.stderr()
    difference, summed, first = json.loads(patch.stdout().strip().splitlines()[-1])
    assert abs(difference) > 1e-2 and summed == pytest.approx(difference, rel=1e-2, abs=1e-3), patch.stdout()
    assert first == pytest.approx(0, abs=1e-3), patch.stdout()


def test_a_tool_that_raises_gives_the_model_the_error(loaded):
    ex = loaded.run(f"%%chat --new --tools raising_tools --output text --max-new-tokens 64\n{QUESTION}", timeout=120)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    assert steps(loaded)[1] == ["halve", {"x": 5}, RAISED, True]
    assert shown_steps(ex)[1] == f'[tool] halve({{"x": 5}}) -> {RAISED}'
    assert loaded.run("print(_chat.text)").stdout().strip() == "Halving failed."


def test_an_interrupt_mid_loop_keeps_the_steps_and_the_kernel(loaded):
    started = threading.Event()

    def in_the_tool(msg) -> bool:
        if msg["msg_type"] == "stream" and "TOOL-STARTED" in msg["content"]["text"]:
            started.set()
        return started.is_set()

    ex, _ = interrupt_when(loaded, f"%%chat --new --tools slow_tools --max-new-tokens 64\n{QUESTION}", in_the_tool)
    assert started.is_set() and ex.status == "ok", ex.error_text() + ex.stderr()
    assert steps(loaded) == [["add", {"a": 2, "b": 3}, "5", False], ["halve", {"x": 5}, "error: interrupted", True]]
    assert loaded.run("print(_chat.finish_reason)").stdout().strip() == "interrupted"
    after = loaded.run(f"%%chat --new --tools tools --output text --max-new-tokens 64\n{QUESTION}", timeout=120)
    assert after.status == "ok", after.error_text()
    assert loaded.run("print(_chat.text)").stdout().strip() == "It is 2.5."


def test_chat_model_runs_the_loop_and_the_cap_stops_it(loaded):
    ex = loaded.run(
        "from shardbook.kernel import ChatModel\n"
        f"whole = ChatModel().chat({QUESTION!r}, tools=tools, max_new_tokens=64)\n"
        f"capped = ChatModel().chat({QUESTION!r}, tools=tools, max_tool_steps=1, max_new_tokens=64)\n"
        "print(json.dumps([whole.text, [s.result for s in whole.steps], capped.text, len(capped.steps)]))",
        timeout=120,
    )
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    assert json.loads(ex.stdout()) == ["It is 2.5.", ["5", "2.5"], "", 1]
    capped = loaded.run(f"%%chat --new --tools tools --max-tool-steps 1 --output text --max-new-tokens 64\n{QUESTION}")
    assert capped.status == "ok", capped.error_text()
    assert "the tool loop stopped after 1 tool calls: the model's last reply calls halve too" in capped.stderr()
