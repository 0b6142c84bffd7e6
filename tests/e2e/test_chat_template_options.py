"""Chat-template options reach the prompt: `%%chat --no-thinking` / `--template-arg` on the batch and alone,
kept by `%chat`, `ChatModel`'s keywords, and the terminal chat's `--template-arg` and `/no_think`, on 2 ranks.

The tiny model's template renders Qwen3's empty think block when `enable_thinking` is false and a `persona`
when one is given; each prompt's token count is compared with the prompt built here with those options."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_terminal_chat import STATUS, assert_all_gone, chat_argv, piped_chat, write_config
from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(240)

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if persona is defined %}({{ persona }}) {% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
OFF = {"enable_thinking": False}
PIRATE = {"persona": "pirate"}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Path:
    """The tiny Llama with the thinking template above."""
    from transformers import AutoTokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("thinker") / "llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def num_prompt_tokens(thinker):
    """The length of the prompt "hi" with these template options, built as every rank builds it."""
    from transformers import AutoTokenizer

    from shardbook.rankd.generation.engine import build_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(thinker)

    def count(options: dict) -> int:
        return build_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], options).shape[1]

    assert count(OFF) > count({}) and count(PIRATE) > count({}), "the test template ignores the options"
    return count


def test_chat_cells_and_chat_model_send_the_template_options(kernel, thinker, num_prompt_tokens):
    ex = kernel.run(f"%load_sharded --model.model_name_or_path {thinker} --inference.system_prompt none", timeout=120)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    assert kernel.run('%chat --reset --system "" --clear-template-args').status == "ok"  # as another module left it

    def sent(flags: str = "") -> int:
        """The prompt tokens of a new one-question conversation "hi" with these flags (its status line)."""
        ex = kernel.run(f"%%chat --new --output text --max-new-tokens 2 {flags}\nhi", timeout=60)
        assert ex.status == "ok", flags + ex.error_text() + ex.stderr()
        return int(ex.stdout().rsplit("[", 1)[1].split()[0])

    for path in ("", "--no-batch"):
        assert sent(path) == num_prompt_tokens({}), path
        assert sent(f"{path} --no-thinking") == num_prompt_tokens(OFF), path
        assert sent(f"{path} --thinking") == num_prompt_tokens({}), path
        assert sent(f"{path} --template-arg persona=pirate") == num_prompt_tokens(PIRATE), path

    kept = kernel.run("%chat --no-thinking --template-arg persona=pirate")
    assert kept.stdout().strip() == '[template] thinking off, persona="pirate"', kept.stdout() + kept.stderr()
    for path in ("", "--no-batch"):
        assert sent(path) == num_prompt_tokens({**OFF, **PIRATE}), path
        assert sent(f"{path} --thinking") == num_prompt_tokens(PIRATE), path  # the cell's flag wins for the cell
    assert '[template] thinking off, persona="pirate"' in kernel.run("%chat --history").stdout()
    assert kernel.run("%chat --clear-template-args").status == "ok"
    assert sent() == num_prompt_tokens({}) and "[template]" not in kernel.run("%chat --history").stdout()

    for flags, message in [
        ("--template-arg enable_thinking", "UsageError: --template-arg needs KEY=VALUE"),
        ("--template-arg tokenize=false", "UsageError: --template-arg tokenize=false: template option 'tokenize'"),
    ]:
        bad = kernel.run(f"%%chat --output text {flags}\nhi")
        assert bad.status == "error" and message in bad.stderr(), bad.error_text() + bad.stderr()
        assert "Traceback" not in bad.stderr()
    unread = kernel.run("%%chat --output text --max-new-tokens 2 --template-arg nosuch=1\nhi")
    assert unread.status == "ok", unread.error_text()
    assert "[shardbook] the model's chat template does not read nosuch: passed to it, it changes nothing" in (
        unread.stderr()
    )

    api = kernel.run(
        "from shardbook.kernel import ChatModel\nm = ChatModel()\n"
        "print(m.chat('hi', thinking=False, max_new_tokens=2).prompt_tokens,"
        " m.chat('hi', batch=True, template_options={'persona': 'pirate'}, max_new_tokens=2).prompt_tokens,"
        " m.generate_many(['hi'], thinking=False, max_new_tokens=2)[0].prompt_tokens)",
        timeout=60,
    )
    assert api.status == "ok", api.error_text()
    expected = [num_prompt_tokens(OFF), num_prompt_tokens(PIRATE), num_prompt_tokens(OFF)]
    assert [int(n) for n in api.stdout().split()] == expected


def test_terminal_chat_template_arg_and_no_think(thinker, num_prompt_tokens, tmp_path):
    """`--template-arg` after CONFIG reaches rank 0 through the launcher; `/no_think`, `/template` on later turns."""
    config = write_config(tmp_path / "thinker.yaml", thinker, max_new_tokens=2)
    lines = ["hi", "/no_think", "/reset", "hi", "/history", "/template", "/reset", "hi", "/template oops", "exit"]
    result, pids = piped_chat(chat_argv(config, "--template-arg", "persona=pirate"), lines, 3)
    assert result.returncode == 0, result.stderr
    prompts = [int(p) for p, _, _ in STATUS.findall(result.stderr)]
    assert prompts == [num_prompt_tokens(PIRATE), num_prompt_tokens({**OFF, **PIRATE}), num_prompt_tokens({})]
    assert '[template] thinking off, persona="pirate"\n[user] hi\n[assistant] ' in result.stderr
    assert "shardbook chat: error: /template needs KEY=VALUE" in result.stderr
    assert_all_gone(pids)
