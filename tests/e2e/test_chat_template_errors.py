"""A chat template that refuses the conversation, through a real 2-rank kernel: ``%%chat`` (on the batch and with
``--no-batch``) is a one-paragraph UsageError naming the template, its message and the fix, and ``ChatModel.chat``
raises the same as a ChatTemplateError (a ValueError) before any rank generates; the kernel answers afterwards."""

from __future__ import annotations

import pytest

from tests.tiny import make_tiny_llama

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
def loaded(kernel, tmp_path_factory):
    tiny = make_tiny_llama(tmp_path_factory.mktemp("template_errors") / "llama")
    ex = kernel.run(f"%load_sharded --model.model_name_or_path {tiny} --inference.system_prompt none", timeout=120)
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
