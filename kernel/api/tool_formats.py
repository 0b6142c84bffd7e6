"""The families' tool-call formats, each read from its documented shape (the formats are facts; see
docs/serving.md, "Tool calls"):

- ``hermes`` (Qwen3, Qwen3-Next): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call.
- ``glm45`` (GLM-4.5/4.6/4.7/5): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``,
  newlines between the parts; a value is a string when the tool's schema says so, else JSON when it parses
  as JSON, else a string.
- ``deepseek_v31`` (DeepSeek-V3.1, V3.2-Exp): ``<｜tool▁calls▁begin｜>`` then per call
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``.
- ``deepseek_v32`` (DeepSeek-V3.2, its "DSML" as its ``encoding/encoding_dsv32.py`` writes it):
  ``<｜DSML｜function_calls>`` then per call ``<｜DSML｜invoke name="NAME">`` with one
  ``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` per argument, then
  ``</｜DSML｜invoke>``; then ``</｜DSML｜function_calls>``, newlines between the parts. ``string="true"``: V is
  the string itself, unquoted; ``"false"``: V is JSON. The tags are ordinary text, not special tokens.
- ``kimi_k2``: ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>`` (``functions.NAME:IDX`` is the call's id), then
  ``<|tool_calls_section_end|>``.
- ``minimax_m2``: ``<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>...</invoke>
  </minimax:tool_call>``, values as glm45's.
- ``harmony`` (gpt-oss): a message whose header is addressed ``to=functions.NAME`` (on the ``commentary``
  channel, ``<|constrain|>json``), its body ``{json}`` up to ``<|call|>``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from shardbook.kernel.api.reasoning import CALL, CHANNEL, HARMONY_ENDS, MESSAGE, START, partial_suffix
from shardbook.kernel.api.tool_parse import MalformedCall, Schemas, ToolCall, ToolFormat, load_json, make_call
from shardbook.rankd.generation.reply_text import FORMAT_TAGS

CALL_OPEN, CALL_CLOSE = FORMAT_TAGS["hermes"]
"""``<tool_call>`` and ``</tool_call>``: hermes' and GLM's."""
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = FORMAT_TAGS["glm45"]
MINIMAX_OPEN, MINIMAX_CLOSE = FORMAT_TAGS["minimax_m2"]


class TaggedFormat(ToolFormat):
    """Calls between an opening and a closing tag, optionally inside a section's tags; text between the calls
    (other than the section's tags and whitespace) is content."""

    call_tags: tuple[str, str] = ("", "")
    section_tags: tuple[str, str] | None = None

    def read_calls(self, tail: str, schemas: Schemas | None = None) -> tuple[str, list[ToolCall]]:
        around, calls, rest = [], [], tail
        opening, closing = self.call_tags
        while rest:
            at = rest.find(opening)
            if at < 0:
                around.append(rest)
                break
            end = rest.find(closing, at + len(opening))
            if end < 0:
                raise MalformedCall(f"a call opened with {opening} is never closed with {closing}")
            around.append(rest[:at])
            calls.append(self.read_call(rest[at + len(opening) : end], schemas or {}))
            rest = rest[end + len(closing) :]
        text = "".join(around)
        for tag in self.section_tags or ():
            text = text.replace(tag, "")
        if not calls:
            raise MalformedCall(f"{self.markers[0]} opens no call")
        return text.strip(), calls

    def read_call(self, body: str, schemas: Schemas) -> ToolCall:
        raise NotImplementedError


class Hermes(TaggedFormat):
    name = "hermes"
    markers = (CALL_OPEN,)
    call_tags = (CALL_OPEN, CALL_CLOSE)

    def read_call(self, body: str, schemas: Schemas) -> ToolCall:
        call = load_json(body, "the call")
        if not isinstance(call, dict):
            raise MalformedCall("the call is not a JSON object with 'name' and 'arguments'")
        arguments = call.get("arguments", call.get("parameters", {}))
        return make_call(call.get("name"), arguments)


def scalar_or_text(value: str, schema: Any) -> Any:
    """A value written bare in an XML-like format (strings as they are, other values as JSON): the text itself
    when the parameter's schema says it is a string (``123`` may be a string), else JSON when it parses."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def read_pairs(body: str, pattern: re.Pattern[str], what: str, schema: Any) -> dict[str, Any]:
    """The key/value pairs `pattern` finds in `body`, typed by the function's parameters' `schema` (if known);
    MalformedCall if anything but whitespace is left."""
    properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
    pairs = {k.strip(): scalar_or_text(v.strip(), properties.get(k.strip())) for k, v in pattern.findall(body)}
    check_only_arguments(body, pattern, what)
    return pairs


def check_only_arguments(body: str, pattern: re.Pattern[str], what: str) -> None:
    """MalformedCall if `body` holds anything but whitespace besides what `pattern` matches (the arguments)."""
    rest = pattern.sub("", body).strip()
    if rest:
        raise MalformedCall(f"{what} has text that is not a complete argument: {rest[:80]!r}")


class Glm45(TaggedFormat):
    name = "glm45"
    markers = (CALL_OPEN,)
    call_tags = (CALL_OPEN, CALL_CLOSE)
    pair = re.compile(
        "{}(.*?){}\\s*{}(.*?){}".format(*map(re.escape, (ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END))), re.DOTALL
    )

    def read_call(self, body: str, schemas: Schemas) -> ToolCall:
        at = body.find(ARG_KEY)
        name, args = (body, "") if at < 0 else (body[:at], body[at:])
        if "\n" in name.strip() or "<" in name:
            raise MalformedCall(f"the call's name {name.strip()[:80]!r} is not a function name")
        return make_call(name, read_pairs(args, self.pair, f"the call of {name.strip()}", schemas.get(name.strip())))


class SectionFormat(TaggedFormat):
    """Calls inside a section's tags, each ``CALL_BEGIN head SEPARATOR {json} CALL_END``; `tags` are the five in
    that order (section begin, call begin, separator, call end, section end), and ``call`` makes a call of the
    head and the arguments."""

    tags: tuple[str, ...] = ()
    head = "name"
    """What the text before the separator is (for errors)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        section_begin, call_begin, cls.separator, call_end, section_end = cls.tags
        cls.markers = (section_begin, call_begin)
        cls.call_tags = (call_begin, call_end)
        cls.section_tags = (section_begin, section_end)

    def read_call(self, body: str, schemas: Schemas) -> ToolCall:
        head, sep, arguments = body.partition(self.separator)
        if not sep:
            raise MalformedCall(f"a call without {self.separator} between its {self.head} and its arguments")
        return self.call(head.strip(), arguments)

    def call(self, head: str, arguments: str) -> ToolCall:
        return make_call(head, arguments)


class DeepSeekV31(SectionFormat):
    name = "deepseek_v31"
    tags = FORMAT_TAGS["deepseek_v31"]


class KimiK2(SectionFormat):
    """The head is the call's id, ``functions.NAME:INDEX``. Kimi-K2-Thinking may start its calls inside a think
    block it never closes: their start (special tokens, never thought) ends the reasoning, as vLLM reads it."""

    name = "kimi_k2"
    tags = FORMAT_TAGS["kimi_k2"]
    head = "id (functions.NAME:INDEX)"
    ends_reasoning = tags[:2]

    def call(self, head: str, arguments: str) -> ToolCall:
        if ":" not in head:
            raise MalformedCall(f"a call whose id {head[:80]!r} is not functions.NAME:INDEX")
        return make_call(head.rsplit(":", 1)[0].removeprefix("functions."), arguments, head)


class MiniMaxM2(TaggedFormat):
    name = "minimax_m2"
    markers = (MINIMAX_OPEN,)
    call_tags = ("<invoke name=", "</invoke>")
    section_tags = (MINIMAX_OPEN, MINIMAX_CLOSE)
    head = re.compile(r'\s*"([^"]*)"\s*>(.*)', re.DOTALL)
    pair = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.DOTALL)

    def read_call(self, body: str, schemas: Schemas) -> ToolCall:
        head = self.head.fullmatch(body)
        if head is None:
            raise MalformedCall('an <invoke> without name="NAME">')
        name, params = head.groups()
        return make_call(name, read_pairs(params, self.pair, f"the call of {name}", schemas.get(name)))


DSML = "｜DSML｜"
"""DeepSeek-V3.2's markup prefix: its tags are ``<｜DSML｜function_calls>``, ``<｜DSML｜invoke ...>``, ..."""


class DeepSeekV32(TaggedFormat):
    """The string attribute types each value (the schema is not needed): ``true`` keeps the text as it is,
    ``false`` reads it as JSON (a value that is not is a malformed call)."""

    name = "deepseek_v32"
    markers = (f"<{DSML}function_calls>", f"<{DSML}invoke name=")
    call_tags = (f"<{DSML}invoke name=", f"</{DSML}invoke>")
    section_tags = (f"<{DSML}function_calls>", f"</{DSML}function_calls>")
    head = re.compile(r'\s*"([^"]*)"\s*>(.*)', re.DOTALL)
    parameter = re.compile(f'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL)

    def read_call(self, body: str, schemas: Schemas) -> ToolCall:
        head = self.head.fullmatch(body)
        if head is None:
            raise MalformedCall(f'an <{DSML}invoke> without name="NAME">')
        name, params = head.groups()
        what = f"the call of {name}"
        check_only_arguments(params, self.parameter, what)
        arguments: dict[str, Any] = {}
        for key, string, value in self.parameter.findall(params):
            if key in arguments:
                raise MalformedCall(f"{what} gives the parameter {key!r} twice")
            arguments[key] = value if string == "true" else self.json_value(value, key, what)
        return make_call(name, arguments)

    @staticmethod
    def json_value(value: str, key: str, what: str) -> Any:
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise MalformedCall(
                f'{what} marks {key} string="false" but its value is not JSON: {value[:80]!r}'
            ) from None


class Harmony(ToolFormat):
    """gpt-oss's calls are messages addressed ``to=functions.NAME``; the rest of a reply (its analysis and final
    messages, markers and all) is left for the harmony reasoning parser, so this format reads the raw reply."""

    name = "harmony"
    markers = (START, CHANNEL, MESSAGE, CALL)
    """The markers a call is written with (this format finds calls by their headers, not by these alone)."""
    before_reasoning = True
    message = MESSAGE
    header_starts = (START, CHANNEL, " to=", "to=")
    recipient = re.compile(r"to=functions\.([^\s<]+)")

    def segments(self, text: str) -> list[tuple[int, str]]:
        """(start, text) of each message in `text`: a message ends at and with an end marker."""
        pattern = "(" + "|".join(re.escape(m) for m in HARMONY_ENDS) + ")"
        out, start = [], 0
        for match in re.finditer(pattern, text):
            out.append((start, text[start : match.end()]))
            start = match.end()
        return [*out, (start, text[start:])]

    def is_call(self, segment: str) -> bool:
        header, sep, _ = segment.partition(self.message)
        return bool(sep) and self.recipient.search(header) is not None

    def call_start(self, text: str) -> int | None:
        return next((start for start, seg in self.segments(text) if self.is_call(seg)), None)

    def held_suffix(self, text: str) -> int:
        start, last = self.segments(text)[-1]
        opening = last.lstrip()
        if self.message not in last and any(h.startswith(opening) or opening.startswith(h) for h in self.header_starts):
            return len(last)  # a header still being written: it may yet name a recipient
        return partial_suffix(text, (*HARMONY_ENDS, START))

    def read_calls(self, tail: str, schemas: Schemas | None = None) -> tuple[str, list[ToolCall]]:
        around, calls = [], []
        for _, segment in self.segments(tail):
            if not self.is_call(segment):
                around.append(segment)
                continue
            header, _, body = segment.partition(self.message)
            name = self.recipient.search(header).group(1)
            body = body.removesuffix(CALL)
            if body.endswith(HARMONY_ENDS):
                raise MalformedCall(f"the call of {name} ends with {body[-7:]} instead of {CALL}")
            calls.append(make_call(name, body))
        return "".join(around), calls


FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (Hermes(), Glm45(), DeepSeekV31(), DeepSeekV32(), KimiK2(), MiniMaxM2(), Harmony())
}
MODEL_TYPES = {
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "qwen3_next": "hermes",
    "glm4_moe": "glm45",
    "glm_moe_dsa": "glm45",
    "deepseek_v3": "deepseek_v31",
    "deepseek_v32": "deepseek_v32",  # V3.2's DSML; V3.2-Exp (same model_type) writes deepseek_v31's calls
    "kimi_k2": "kimi_k2",
    "minimax_m2": "minimax_m2",
    "gpt_oss": "harmony",
}
"""A model's config ``model_type`` -> its family's format."""
TELLTALES = (
    ("deepseek_v31", (DeepSeekV31.tags[0], DeepSeekV31.separator)),
    ("kimi_k2", (KimiK2.tags[0], KimiK2.separator)),
    ("minimax_m2", (MINIMAX_OPEN,)),
    ("harmony", (CHANNEL, CALL)),
    ("glm45", (CALL_OPEN, ARG_KEY, ARG_VALUE)),
    ("hermes", (CALL_OPEN, CALL_CLOSE)),
)
"""Tokens whose presence in a vocabulary shows a format, in the order they are tried."""
