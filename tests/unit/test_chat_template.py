"""The chat template applied on every rank (``rankd/generation/chat_template.py``): earlier calls' arguments in the
shape the template reads, a template's failure as one error naming it, and ``model.chat_template``'s file in place
of the tokenizer's own."""

from __future__ import annotations

import pytest

from shardbook.rankd.config.schema import ModelConfig
from shardbook.rankd.generation.chat_template import ChatTemplateError, joins_arguments, template_messages
from shardbook.rankd.generation.engine import build_prompt_ids
from shardbook.rankd.loading.load_sharded import _with_chat_template
from tests.tiny import make_tokenizer


@pytest.mark.parametrize(
    ("template", "joins"),
    [
        ("{{ '<sep>' + tool['function']['arguments'] + '<end>' }}", True),  # DeepSeek-V3/V3.1's own
        ("{{ call.function.arguments + '<end>' }}", True),
        ("{{ '<sep>' ~ call.function.arguments }}", True),
        ("{% set args = call.function.arguments %}{{ '<sep>' + args }}", True),
        ("{{ call.function.arguments | tojson }}", False),  # Qwen3's, Kimi-K2's
        ("{% for k, v in call.function.arguments.items() %}{{ k + '=' + v }}{% endfor %}", False),  # GLM's
        ("{{ '<sep>' + call.function.name }}", False),
    ],
)
def test_a_template_joining_arguments_onto_text_is_told_apart(template, joins):
    assert joins_arguments(template) is joins


def test_without_transformers_helper_a_sandbox_parses_and_an_unparsable_template_gets_mappings(monkeypatch):
    """transformers' environment helper is private: where it is missing a sandboxed environment tells templates
    apart the same way, and a template that does not parse is left to its own render to report."""
    import transformers.utils.chat_template_utils as utils

    monkeypatch.delattr(utils, "_compile_jinja_template")
    joins_arguments.cache_clear()
    try:
        assert joins_arguments("{{ '<sep>' + tool['function']['arguments'] + '<end>' }}") is True
        assert joins_arguments("{{ call.function.arguments | tojson }}") is False
        assert joins_arguments("{{ call.function.arguments + ") is False
    finally:
        joins_arguments.cache_clear()


def call_message(arguments):
    return {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}


def arguments_of(messages):
    return messages[0]["tool_calls"][0]["function"]["arguments"]


def test_arguments_go_as_text_or_as_a_mapping_and_the_callers_messages_stay():
    sent = [call_message('{"a":1}')]
    assert arguments_of(template_messages(sent, as_text=True)) == '{"a":1}'  # the text as it came
    assert arguments_of(template_messages(sent, as_text=False)) == {"a": 1}
    mapping = [call_message({"a": "é"})]
    assert arguments_of(template_messages(mapping, as_text=True)) == '{"a": "é"}'
    assert arguments_of(template_messages([call_message("not json")], as_text=False)) == "not json"
    assert arguments_of(sent) == '{"a":1}' and arguments_of(mapping) == {"a": "é"}


def test_a_template_that_raises_is_an_error_naming_the_template_and_the_fix():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(ChatTemplateError, match="chat template cannot render.*System role not supported") as info:
        build_prompt_ids(tokenizer, [{"role": "system", "content": "Be brief."}])
    assert isinstance(info.value, ValueError) and "change the conversation" in str(info.value)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content "  # never closed
    with pytest.raises(ChatTemplateError, match="TemplateSyntaxError"):
        build_prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}])


def test_model_chat_template_replaces_the_tokenizers_and_a_file_it_cannot_read_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="model.chat_template is empty: give the path of a Jinja chat template"):
        ModelConfig(chat_template=" ")
    assert ModelConfig().chat_template is None
    tokenizer = make_tokenizer()
    own = tokenizer.chat_template
    assert _with_chat_template(tokenizer, None).chat_template == own
    missing = tmp_path / "missing.jinja"
    with pytest.raises(ValueError, match=f"model.chat_template: cannot read {missing} on .*No such file.*or null"):
        _with_chat_template(tokenizer, str(missing))
    (tmp_path / "empty.jinja").write_text("\n")
    with pytest.raises(ValueError, match="empty.jinja is empty"):
        _with_chat_template(tokenizer, str(tmp_path / "empty.jinja"))
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    tokenizer = _with_chat_template(tokenizer, str(template))
    ids = build_prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}])[0].tolist()
    assert tokenizer.decode(ids) == "[user] Hi\n[assistant]"
