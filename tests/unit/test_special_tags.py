"""Format tags that are special tokens (gpt-oss's harmony markers, Kimi-K2's call tokens) stay in a reply's text
for the parsers, and only they: the other special tokens are still dropped. A taught model reads them from real
generated tokens in ``tool_serve_check.py`` (test_tool_endpoint.py)."""

from __future__ import annotations

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
