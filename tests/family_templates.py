"""Chat templates written from each family's documented prompt format, and tiny tokenizers that carry them.

The real tokenizers and templates of Qwen3, GLM-4.5/4.6, GLM-4.7/5, DeepSeek-V3.1/V3.2, Kimi-K2-Instruct and MiniMax-M2
are not available offline, so each is written here, minimal but with the markers, whitespace and rules its family
really uses: the tools list, earlier assistant ``tool_calls`` in the family's own call format, ``role: "tool"``
results, the thinking switch, and which earlier reasoning is dropped. The instructions a real template writes
around the tools are paraphrased (only their format line matters). Per family:

- ``hermes`` (Qwen3): ChatML; thinking off writes an empty ``<think>`` block after the prompt; reasoning is kept
  for assistant turns after the last user message (inside a tool loop) and dropped before it.
- ``glm45`` (GLM-4.5/4.6): ``[gMASK]<sop>``, ``<|user|>\\n``, calls as ``<tool_call>NAME\\n<arg_key>...``;
  thinking off appends ``/nothink`` to user turns and ``\\n<think></think>`` to the prompt; reasoning as Qwen3's.
- ``glm5`` (GLM-4.7/5): the prompt opens ``<think>`` itself (``<think></think>`` when off), calls without
  newlines; ``clear_thinking=false`` keeps every earlier turn's reasoning.
- ``deepseek_v31``: one system prompt with the tools; ``thinking`` (default off) ends the prompt with ``<think>``
  or ``</think>``; earlier reasoning is always dropped; after a tool's output there is no new assistant header.
- ``deepseek_v32``: as its ``encoding/encoding_dsv32.py`` writes prompts (V3.2 ships no template): each user turn
  ends ``<｜Assistant｜>`` then ``<think>`` (thinking, the last user turn) or ``</think>``; calls in DSML; results
  as ``<function_results>`` then ``<think>`` or ``</think>``; reasoning kept after the last user message.
- ``kimi_k2`` (Kimi-K2-Instruct): no thinking; a call's head is its id ``functions.NAME:IDX``; results as
  ``## Return of ID``.
- ``minimax_m2``: always thinks (the prompt opens ``<think>``); reasoning kept after the last user message.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.tiny import make_tokenizer

HERMES = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nThe functions you may call, within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nWrite each call as a JSON object within <tool_call></tool_call> XML tags:\n' }}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_user and m.reasoning_content %}
            {{- '<think>\n' + m.reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- m.content }}
        {%- for call in m.tool_calls or [] %}
            {%- if not loop.first or m.content %}{{- '\n' }}{%- endif %}
            {%- set args = call.function.arguments %}
            {{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- (args if args is string else args | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

GLM_LAST_USER = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
"""
"""Where the current question starts: GLM keeps the reasoning of assistant turns after it (a tool loop's)."""

GLM45 = (
    r"""
{{- '[gMASK]<sop>' }}
{%- if tools %}
    {{- '<|system|>\n# Tools\n\nThe functions you may call, within <tools></tools> XML tags:\n<tools>\n' }}
    {%- for tool in tools %}{{- tool | tojson + '\n' }}{%- endfor %}
    {{- '</tools>\n\nWrite each call in this XML format:\n<tool_call>{function-name}\n' }}
    {{- '<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>' }}
{%- endif %}"""
    + GLM_LAST_USER
    + r"""
{%- for m in messages %}
    {%- if m.role == 'system' %}
        {{- '<|system|>\n' + m.content }}
    {%- elif m.role == 'user' %}
        {{- '<|user|>\n' + m.content }}
        {%- if enable_thinking is defined and not enable_thinking and not m.content.endswith('/nothink') %}
            {{- '/nothink' }}
        {%- endif %}
    {%- elif m.role == 'assistant' %}
        {%- if loop.index0 > ns.last_user and m.reasoning_content is string and m.reasoning_content %}
            {{- '<|assistant|>\n<think>' + m.reasoning_content.strip() + '</think>' }}
        {%- else %}
            {{- '<|assistant|>\n<think></think>' }}
        {%- endif %}
        {%- if m.content.strip() %}{{- '\n' + m.content.strip() }}{%- endif %}
        {%- for call in m.tool_calls or [] %}
            {{- '\n<tool_call>' + call.function.name }}
            {%- for k, v in call.function.arguments.items() %}
                {{- '\n<arg_key>' + k + '</arg_key>\n<arg_value>' + (v if v is string else v | tojson) }}
                {{- '</arg_value>' }}
            {%- endfor %}
            {{- '\n</tool_call>' }}
        {%- endfor %}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|observation|>' }}{%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{- '\n<think></think>' }}{%- endif %}
{%- endif %}
"""
)

GLM5 = (
    r"""
{{- '[gMASK]<sop>' }}
{%- if tools %}
    {{- '<|system|>\n# Tools\n\nThe functions you may call, within <tools></tools> XML tags:\n<tools>\n' }}
    {%- for tool in tools %}{{- tool | tojson + '\n' }}{%- endfor %}
    {{- '</tools>\n\nWrite each call in this XML format:\n<tool_call>{function-name}' }}
    {{- '<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>' }}
{%- endif %}"""
    + GLM_LAST_USER
    + r"""
{%- set keep_all = clear_thinking is defined and not clear_thinking %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
        {{- '<|system|>' + m.content }}
    {%- elif m.role == 'user' %}
        {{- '<|user|>' + m.content }}
    {%- elif m.role == 'assistant' %}
        {%- if (keep_all or loop.index0 > ns.last_user) and m.reasoning_content is string %}
            {{- '<|assistant|><think>' + m.reasoning_content + '</think>' }}
        {%- else %}
            {{- '<|assistant|><think></think>' }}
        {%- endif %}
        {{- m.content.strip() }}
        {%- for call in m.tool_calls or [] %}
            {{- '<tool_call>' + call.function.name }}
            {%- for k, v in call.function.arguments.items() %}
                {{- '<arg_key>' + k + '</arg_key><arg_value>' + (v if v is string else v | tojson) + '</arg_value>' }}
            {%- endfor %}
            {{- '</tool_call>' }}
        {%- endfor %}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|observation|>' }}{%- endif %}
        {{- '<tool_response>' + m.content + '</tool_response>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' + ('<think></think>' if enable_thinking is defined and not enable_thinking else '<think>') }}
{%- endif %}
"""
)

DEEPSEEK_V31 = r"""
{%- set ns = namespace(system='', after_user=false) %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + m.content %}{%- endif %}
{%- endfor %}
{%- if tools %}
    {%- set ns.system = ns.system + '\n\n## Tools\nYou have access to the following tools:\n' %}
    {%- for tool in tools %}
        {%- set ns.system = ns.system + '\n### ' + tool.function.name + '\nDescription: '
            + (tool.function.description or '') + '\n\nParameters: ' + tool.function.parameters | tojson + '\n' %}
    {%- endfor %}
    {%- set ns.system = ns.system + '\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n'
        + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments'
        + '<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n' %}
{%- endif %}
{{- '<｜begin▁of▁sentence｜>' + ns.system }}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {{- '<｜User｜>' + m.content }}
        {%- set ns.after_user = true %}
    {%- elif m.role == 'assistant' %}
        {%- if ns.after_user %}{{- '<｜Assistant｜></think>' }}{%- endif %}
        {{- m.content.split('</think>', 1)[-1] }}
        {%- if m.tool_calls %}
            {{- '<｜tool▁calls▁begin｜>' }}
            {%- for call in m.tool_calls %}
                {%- set args = call.function.arguments %}
                {{- '<｜tool▁call▁begin｜>' + call.function.name + '<｜tool▁sep｜>' }}
                {{- (args if args is string else args | tojson) + '<｜tool▁call▁end｜>' }}
            {%- endfor %}
            {{- '<｜tool▁calls▁end｜>' }}
        {%- endif %}
        {{- '<｜end▁of▁sentence｜>' }}
        {%- set ns.after_user = false %}
    {%- elif m.role == 'tool' %}
        {{- '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}
        {%- set ns.after_user = false %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt and ns.after_user %}
    {{- '<｜Assistant｜>' + ('<think>' if thinking is defined and thinking else '</think>') }}
{%- endif %}
"""

DEEPSEEK_V32 = r"""
{%- set thinking = thinking is defined and thinking %}
{%- set ns = namespace(last_user=-1, calls=0, results=0) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{{- '<｜begin▁of▁sentence｜>' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}
{%- if tools %}
    {{- '\n\n## Tools\nYou may call the functions below by writing a "<｜DSML｜function_calls>" block:\n' }}
    {{- '<｜DSML｜function_calls>\n<｜DSML｜invoke name="$FUNCTION_NAME">\n' }}
    {{- '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n' }}
    {{- '...\n</｜DSML｜invoke>\n</｜DSML｜function_calls>\n' }}
    {{- 'string="true" for string parameters, written as they are; "false" for the others, written as JSON.\n' }}
    {{- '<functions>\n' }}
    {%- for tool in tools %}{{- tool.function | tojson + '\n' }}{%- endfor %}
    {{- '</functions>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {{- '<｜User｜>' + m.content + '<｜Assistant｜>' }}
        {{- '<think>' if thinking and loop.index0 == ns.last_user else '</think>' }}
    {%- elif m.role == 'assistant' %}
        {%- if thinking and loop.index0 > ns.last_user %}{{- (m.reasoning_content or '') + '</think>' }}{%- endif %}
        {{- m.content }}
        {%- if m.tool_calls %}
            {{- '\n\n<｜DSML｜function_calls>' }}
            {%- for call in m.tool_calls %}
                {{- '\n<｜DSML｜invoke name="' + call.function.name + '">' }}
                {%- for k, v in call.function.arguments.items() %}
                    {{- '\n<｜DSML｜parameter name="' + k + '" string="' }}
                    {{- ('true' if v is string else 'false') + '">' }}
                    {{- (v if v is string else v | tojson) + '</｜DSML｜parameter>' }}
                {%- endfor %}
                {{- '\n</｜DSML｜invoke>' }}
            {%- endfor %}
            {{- '\n</｜DSML｜function_calls>' }}
            {%- set ns.calls, ns.results = m.tool_calls | length, 0 %}
        {%- endif %}
        {{- '<｜end▁of▁sentence｜>' }}
    {%- elif m.role == 'tool' %}
        {%- set ns.results = ns.results + 1 %}
        {%- if ns.results == 1 %}{{- '\n\n<function_results>' }}{%- endif %}
        {{- '\n<result>' + m.content + '</result>' }}
        {%- if ns.results == ns.calls %}
            {{- '\n</function_results>\n\n' + ('<think>' if thinking and loop.index0 > ns.last_user else '</think>') }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
"""

KIMI_K2 = r"""
{%- if tools %}{{- '<|im_system|>tool_declare<|im_middle|>' + tools | tojson + '<|im_end|>' }}{%- endif %}
{%- if not messages or messages[0].role != 'system' %}
    {{- '<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>' }}
{%- endif %}
{%- for m in messages %}
    {%- set name = m.name or m.role %}
    {%- if m.role == 'user' %}{{- '<|im_user|>' + name + '<|im_middle|>' }}
    {%- elif m.role == 'assistant' %}{{- '<|im_assistant|>' + name + '<|im_middle|>' }}
    {%- else %}{{- '<|im_system|>' + name + '<|im_middle|>' }}
    {%- endif %}
    {%- if m.role == 'tool' %}
        {{- '## Return of ' + m.tool_call_id + '\n' + m.content }}
    {%- else %}
        {{- m.content }}
        {%- if m.tool_calls %}
            {{- '<|tool_calls_section_begin|>' }}
            {%- for call in m.tool_calls %}
                {%- set args = call.function.arguments %}
                {{- '<|tool_call_begin|>' + call.id + '<|tool_call_argument_begin|>' }}
                {{- (args if args is string else args | tojson) + '<|tool_call_end|>' }}
            {%- endfor %}
            {{- '<|tool_calls_section_end|>' }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}
"""

MINIMAX_M2 = r"""
{%- set system = messages[0] if messages and messages[0].role == 'system' else none %}
{%- set turns = messages[1:] if system else messages %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in turns %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{{- ']~!b[]~b]system\n' + (system.content if system else 'You are a helpful assistant.') }}
{%- if tools %}
    {{- '\n\n# Tools\nThe tools you may call, in JSONSchema format:\n\n<tools>\n' }}
    {%- for tool in tools %}{{- '<tool>' + tool.function | tojson + '</tool>\n' }}{%- endfor %}
    {{- '</tools>\n\nWrite tool calls in this XML format:\n\n<minimax:tool_call>\n<invoke name="tool-name-1">\n' }}
    {{- '<parameter name="param-key-1">param-value-1</parameter>\n...\n</invoke>\n</minimax:tool_call>' }}
{%- endif %}
{{- '[e~[\n' }}
{%- for m in turns %}
    {%- if m.role == 'user' %}
        {{- ']~b]user\n' + m.content + '[e~[\n' }}
    {%- elif m.role == 'assistant' %}
        {{- ']~b]ai\n' }}
        {%- if m.reasoning_content and loop.index0 > ns.last_user %}
            {{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}
        {%- endif %}
        {{- m.content }}
        {%- if m.tool_calls %}
            {{- '\n<minimax:tool_call>\n' }}
            {%- for call in m.tool_calls %}
                {{- '<invoke name="' + call.function.name + '">\n' }}
                {%- for k, v in call.function.arguments.items() %}
                    {{- '<parameter name="' + k + '">' + (v if v is string else v | tojson) + '</parameter>\n' }}
                {%- endfor %}
                {{- '</invoke>\n' }}
            {%- endfor %}
            {{- '</minimax:tool_call>' }}
        {%- endif %}
        {{- '[e~[\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or turns[loop.index0 - 1].role != 'tool' %}{{- ']~b]tool' }}{%- endif %}
        {{- '\n<response>' + m.content + '</response>' }}
        {%- if loop.last or turns[loop.index0 + 1].role != 'tool' %}{{- '[e~[\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- ']~b]ai\n<think>\n' }}{%- endif %}
"""

THINK = ("<think>", "</think>")
DEEPSEEK_CONTROLS = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
GLM_CONTROLS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
GLM_TAGS = (*THINK, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


@dataclass(frozen=True)
class Family:
    """One family's template and the tokens its tokenizer must hold for it."""

    name: str
    template: str
    parser: str
    """Its tool-call format, a name of ``kernel/api/tool_formats.FORMATS``."""
    controls: tuple[str, ...]
    """Role and turn markers the template writes: special tokens, as in the family's tokenizer."""
    tags: tuple[str, ...]
    """Think and call tags: added tokens of their own, special only where the family's tokenizer marks them so
    (``special_tags``)."""
    model_type: str
    """A config ``model_type`` of the family (what shardbook picks the parser by)."""
    special_tags: bool = False
    thinking: str | None = None
    """The template's thinking switch, None where it has none."""

    def tokenizer(self):
        """The tiny byte-level tokenizer with this family's tokens and template."""
        tokenizer = make_tokenizer()
        tokenizer.add_tokens(list(self.controls), special_tokens=True)
        tokenizer.add_tokens(list(self.tags), special_tokens=self.special_tags)
        tokenizer.chat_template = self.template
        return tokenizer


FAMILIES = {
    f.name: f
    for f in (
        Family(
            "hermes", HERMES, "hermes", (), (*THINK, "<tool_call>", "</tool_call>"), "qwen3", thinking="enable_thinking"
        ),
        Family("glm45", GLM45, "glm45", GLM_CONTROLS, GLM_TAGS, "glm4_moe", thinking="enable_thinking"),
        Family("glm5", GLM5, "glm45", GLM_CONTROLS, GLM_TAGS, "glm_moe_dsa", thinking="enable_thinking"),
        Family(
            "deepseek_v31",
            DEEPSEEK_V31,
            "deepseek_v31",
            DEEPSEEK_CONTROLS,
            (
                *THINK,
                *("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
                *("<｜tool▁calls▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
            ),
            "deepseek_v3",
            thinking="thinking",
        ),
        Family(
            "deepseek_v32", DEEPSEEK_V32, "deepseek_v32", DEEPSEEK_CONTROLS, THINK, "deepseek_v32", thinking="thinking"
        ),
        Family(
            "kimi_k2",
            KIMI_K2,
            "kimi_k2",
            ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"),
            (
                *("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>"),
                *("<|tool_call_end|>", "<|tool_calls_section_end|>"),
            ),
            "kimi_k2",
            special_tags=True,
        ),
        Family(
            "minimax_m2",
            MINIMAX_M2,
            "minimax_m2",
            ("]~!b[", "]~b]", "[e~["),
            (*THINK, "<minimax:tool_call>", "</minimax:tool_call>"),
            "minimax_m2",
        ),
    )
}
"""The families by template name; ``glm45`` and ``glm5`` share the ``glm45`` parser."""
