"""Format tags that are special tokens (gpt-oss's harmony markers, Kimi-K2's call tokens) stay in a reply's text
for the parsers, and only they: the other special tokens are still dropped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardbook.rankd.generation.reply_text import kept_tags, reply_decoder
from tests.tiny import IM_END, IM_START, make_tokenizer

HARMONY = ["<|channel|>", "<|message|>", "<|end|>"]


def test_the_decode_keeps_a_formats_special_tags_and_drops_the_rest():
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, *HARMONY]})
    ids = tokenizer("<|channel|>analysis<|message|>Hm.<|end|>" + IM_END, add_special_tokens=False)["input_ids"]
    assert set(kept_tags(tokenizer)) == set(HARMONY)
    assert reply_decoder(tokenizer)(ids) == "<|channel|>analysis<|message|>Hm.<|end|>"  # im_end dropped
    assert tokenizer.decode(ids, skip_special_tokens=True) == "analysisHm."  # what replies were before


def test_generic_tags_of_a_format_the_vocabulary_lacks_stay_dropped():
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, "<|end|>"]})  # as Phi-3's
    ids = tokenizer("Hi.<|end|>", add_special_tokens=False)["input_ids"]
    assert kept_tags(tokenizer) == {}
    assert reply_decoder(tokenizer)(ids) == "Hi."


@pytest.mark.timeout(300)
def test_a_taught_model_with_special_format_tags_reasons_and_calls_on_both_paths():
    """Real generated tokens (`special_tags_check.py`): harmony reasoning, a harmony call and a Kimi call read
    from replies whose markers are special tokens, whole and streamed, on the batch and the single path."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("special_tags_check.py"))],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    paris = [["get_weather", {"city": "Paris"}]]
    for where in ("batch", "no_batch"):
        for whole_or_streamed in range(2):
            finish, reasoning, content, calls = found[f"{where}_call"][whole_or_streamed]
            assert (finish, reasoning, calls) == ("tool_calls", "Need the weather.", paris), found
            assert not content, found  # no header or marker leaks into the content
            assert found[f"{where}_answer"][whole_or_streamed][:3] == ["stop", "It said sunny.", "Sunny."], found
            finish, _, content, calls = found[f"{where}_kimi"][whole_or_streamed]
            assert (finish, calls) == ("tool_calls", paris) and not content, found
        assert found[f"{where}_chat_model"] == ["A greeting.", "Hello!"], found
