"""%%chat shows a reply's reasoning apart from its answer, on 2 ranks: a tiny model taught to answer "Hello" with a
think block, its reasoning in the widget's own part and marked in plain text, `_chat.reasoning` / `_chat.text`,
`%chat --history`, and the next turn's prompt built by the template's rule for earlier reasoning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.test_chat import final_outputs
from tests.e2e.test_terminal_chat import assert_all_gone, chat_argv, piped_chat, write_config
from tests.taught import THINK_TAGS, save_taught, tag_tokenizer, teach

pytestmark = pytest.mark.timeout(240)

REASONING, ANSWER = "Greet back.", "Hello!"
REASONING_PART = re.compile(r"<div class='shardbook-reasoning'[^>]*>(.*?)</div>", re.S)
"""The text of the widget's reasoning part in a comm message's value."""
KEEPING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if keep_reasoning is defined and keep_reasoning and m.reasoning_content %}"
    "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Drops earlier reasoning, as most families' templates do, unless ``keep_reasoning`` is set."""


def prompt_length(tokenizer, messages: list[dict], options: dict | None = None) -> int:
    from shardbook.rankd.generation.engine import build_prompt_ids

    return build_prompt_ids(tokenizer, messages, options).shape[1]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> tuple[Path, object]:
    """The taught model saved where `%load_sharded` reads it, and its tokenizer."""
    tokenizer = tag_tokenizer(THINK_TAGS, KEEPING_TEMPLATE)
    hello = [{"role": "user", "content": "Hello"}]
    from shardbook.rankd.generation.engine import build_prompt_ids

    model = teach(tokenizer, [(build_prompt_ids(tokenizer, hello)[0].tolist(), f"<think>{REASONING}</think>{ANSWER}")])
    return save_taught(tmp_path_factory.mktemp("thinker") / "llama", model, tokenizer), tokenizer


def test_reasoning_apart_in_the_widget_chat_history_and_next_prompt(kernel, thinker):
    path, tokenizer = thinker
    ex = kernel.run(f"%load_sharded --model.model_name_or_path {path} --inference.system_prompt none", timeout=120)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    assert kernel.run('%chat --reset --system "" --clear-template-args').status == "ok"

    ex = kernel.run("%%chat --max-new-tokens 24\nHello", timeout=60)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    values = [str(m["content"].get("data", {}).get("state", {}).get("value", "")) for m in ex.of_type("comm_msg")]
    live = [found.group(1) for value in values if (found := REASONING_PART.search(value))]
    # The widget is refreshed at a bounded rate, so how much of the reasoning a refresh shows depends on the
    # machine's speed: any of it, and nothing of the answer, in the reasoning's own part.
    assert any(shown and REASONING.startswith(shown) for shown in live), f"no reasoning streamed into its part: {live}"
    assert all(REASONING.startswith(shown) for shown in live), f"the reasoning part showed more than reasoning: {live}"
    [reply] = [o["data"] for o in final_outputs(ex) if "text/markdown" in o["data"]]
    assert reply["text/markdown"].startswith("<details><summary>Reasoning</summary>\n\n> Greet back.\n")
    assert reply["text/markdown"].endswith(f"</details>\n\n{ANSWER}")
    assert reply["text/plain"] == f"[reasoning]\n{REASONING}\n[answer]\n{ANSWER}"
    parts = kernel.run("print(repr(_chat.reasoning), repr(_chat.text), _chat.finish_reason)").stdout().strip()
    assert parts == f"{REASONING!r} {ANSWER!r} stop"

    history = kernel.run("%chat --history").stdout()
    assert f"[assistant reasoning] {REASONING}\n[assistant] {ANSWER}" in history, history
    kept = {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}
    asked = [{"role": "user", "content": "Hello"}, kept, {"role": "user", "content": "Hello"}]
    raw = [asked[0], {"role": "assistant", "content": f"<think>{REASONING}</think>{ANSWER}"}, asked[2]]

    def second_turn_tokens(flags: str) -> int:
        ex = kernel.run(f"%%chat --output text --max-new-tokens 24 {flags}\nHello", timeout=60)
        assert ex.status == "ok", ex.error_text() + ex.stderr()
        assert kernel.run("%chat --reset").status == "ok"
        first = kernel.run("%%chat --output text --max-new-tokens 24\nHello")  # the first turn again
        assert first.stdout().startswith(f"[reasoning]\n{REASONING}\n[answer]\n{ANSWER}\n["), first.stdout()
        return int(ex.stdout().rsplit("[", 1)[1].split()[0])

    dropped = second_turn_tokens("")
    assert dropped == prompt_length(tokenizer, asked) < prompt_length(tokenizer, raw)
    kept_tokens = second_turn_tokens("--template-arg keep_reasoning=true")
    assert kept_tokens == prompt_length(tokenizer, asked, {"keep_reasoning": True}) > dropped


def test_the_terminal_chat_marks_the_reasoning(thinker, tmp_path):
    path, _ = thinker
    result, pids = piped_chat(chat_argv(write_config(tmp_path / "thinker.yaml", path, 24)), ["Hello", "/history"], 3)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"[reasoning]\n{REASONING}\n[answer]\n{ANSWER}\n"), result.stdout
    assert f"[assistant reasoning] {REASONING}\n[assistant] {ANSWER}" in result.stderr
    assert_all_gone(pids)
