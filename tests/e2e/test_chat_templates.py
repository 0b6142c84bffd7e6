"""Chat templates through a real 2-rank kernel.

A template that refuses the conversation: ``%%chat`` (on the batch and with ``--no-batch``) is a one-paragraph
UsageError naming the template, its message and the fix, and ``ChatModel.chat`` raises the same as a
ChatTemplateError (a ValueError) before any rank generates; the kernel answers afterwards. ``model.chat_template``:
a file that cannot be read fails the load naming the key and the fix; a readable one is every rank's template."""

from __future__ import annotations

import pytest

from tests.tiny import CHATML_TEMPLATE, make_tiny_llama

pytestmark = pytest.mark.timeout(240)

REFUSE = (
    "%%all\nsaved_template = tokenizer.chat_template\n"
    "tokenizer.chat_template = \"{{ raise_exception('System messages are not supported') }}\""
)
RESTORE = "%%all\ntokenizer.chat_template = saved_template"
NAMED = (
    "chat template cannot render this conversation",
    "System messages are not supported",
    "change the conversation",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("templates") / "llama")


def load(kernel, tiny, *options: str):
    return kernel.run(
        f"%load_sharded --model.model_name_or_path {tiny} --inference.system_prompt none {' '.join(options)}",
        timeout=120,
    )


@pytest.fixture(scope="module")
def loaded(kernel, tiny):
    ex = load(kernel, tiny)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    return kernel


def test_a_template_that_refuses_the_conversation_is_an_error_naming_it(loaded):
    assert loaded.run(REFUSE).status == "ok"
    try:
        for path in ("", "--no-batch"):
            ex = loaded.run(f"%%chat {path} --output text --max-new-tokens 5\nhello", timeout=60)
            text = ex.error_text() + ex.stderr()
            assert ex.status == "error" and ex.reply["content"]["ename"] == "UsageError", (path, text)
            assert all(part in text for part in NAMED) and "Traceback" not in text, (path, text)
        ex = loaded.run("from shardbook.kernel.api.chat import ChatModel\nChatModel().chat('hello', max_new_tokens=5)")
        assert ex.status == "error" and ex.reply["content"]["ename"] == "ChatTemplateError", ex.error_text()
        assert all(part in ex.reply["content"]["evalue"] for part in NAMED), ex.error_text()
    finally:
        assert loaded.run(RESTORE).status == "ok"
    assert loaded.run("%%chat --output text --max-new-tokens 3\nstill there?", timeout=60).status == "ok"


def test_model_chat_template_is_every_ranks_template(loaded, tiny, tmp_path):
    missing = tmp_path / "missing.jinja"
    ex = load(loaded, tiny, f"--model.chat_template {missing}")
    text = ex.error_text() + ex.stderr()
    assert ex.status == "error" and f"model.chat_template: cannot read {missing}" in text and "or null" in text, text
    mine = tmp_path / "mine.jinja"
    mine.write_text("{{ '<|im_start|>system\\nFrom my file.<|im_end|>\\n' }}" + CHATML_TEMPLATE)
    try:
        assert load(loaded, tiny, f"--model.chat_template {mine}").status == "ok"
        ex = loaded.run(f"%%all\nprint('mine:', tokenizer.chat_template == open({str(mine)!r}).read())")
        assert ex.stdout().count("mine: True") == 2, ex.stdout() + ex.error_text()
        for path in ("", "--no-batch"):  # --no-batch: each rank renders the prompt, and they must agree
            ex = loaded.run(f"%%chat {path} --output text --max-new-tokens 3\nhello", timeout=60)
            assert ex.status == "ok", ex.error_text() + ex.stderr()
    finally:
        assert load(loaded, tiny).status == "ok"
