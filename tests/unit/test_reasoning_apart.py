"""A reply's reasoning apart from its answer on rank 0's side: the text marks, the final display data, the
conversation's kept turn (``reasoning_content``) and its history."""

from __future__ import annotations

import io

from shardbook.kernel.api.chat import ChatResponse
from shardbook.kernel.api.conversation import Conversation
from shardbook.kernel.api.reasoning import ReasoningFormat, Split
from shardbook.kernel.api.replies import ReplyParts
from shardbook.magics.views.chat_view import TextChatView, final_data


def test_text_view_marks_the_reasoning_and_the_answer():
    out = io.StringIO()
    view = TextChatView(out)
    parts = ReplyParts(ReasoningFormat("think"))
    for chunk in ["<thi", "nk>Let me", " see.</th", "ink>Four", "."]:
        view.add(parts.feed(chunk))
    view.add(parts.finish())
    view.finish("done")
    assert out.getvalue() == "[reasoning]\nLet me see.\n[answer]\nFour.\n[done]\n"
    again = TextChatView(io.StringIO())
    for piece in [Split(content="A."), Split(reasoning="Hm."), Split(content="B.")]:  # interleaved thinking
        again.add(piece)
    assert again.text == "A.\n[reasoning]\nHm.\n[answer]\nB."


def test_final_display_data_quotes_the_reasoning_in_a_collapsed_block():
    data = final_data(Split("one\ntwo", "Answer."))
    assert data["text/markdown"] == "<details><summary>Reasoning</summary>\n\n> one\n> two\n\n</details>\n\nAnswer."
    assert data["text/plain"] == "[reasoning]\none\ntwo\n[answer]\nAnswer."
    assert final_data(Split("", "Answer.")) == {"text/markdown": "Answer.", "text/plain": "Answer."}


def test_response_apart_and_the_turn_kept_as_the_template_reads_it():
    raw = ChatResponse(
        text="<think>Sum it.</think>4", prompt_tokens=3, generated_tokens=5, finish_reason="stop",
        time_to_first_token_s=0.1, tokens_per_s=10.0, seed=1,
    )  # fmt: skip
    response = ReplyParts(ReasoningFormat("think")).apart(raw)
    assert (response.reasoning, response.text, response.seed) == ("Sum it.", "4", 1)
    assert ReplyParts(ReasoningFormat("none")).apart(raw).reasoning == ""

    conversation = Conversation()
    conversation.add_turn("2+2?", response.text, response.finish_reason, response.reasoning)
    assert conversation.request_messages("and 3+3?") == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Sum it."},
        {"role": "user", "content": "and 3+3?"},
    ]
    assert conversation.history_text() == "[user] 2+2?\n[assistant reasoning] Sum it.\n[assistant] 4"
