"""The help text of the parser options that `shardbook serve` and `%serve` share.

A module of its own so that `%serve`'s arguments cost no import of the server (and, through it, transformers) at the
kernel's start.
"""

from __future__ import annotations

from shardbook.kernel.api.reasoning import PARSERS
from shardbook.kernel.api.tool_calls import FORMATS

REASONING_PARSER_HELP = (
    "how chat replies' reasoning is read apart from the answer (reasoning_content): auto (from the model's config "
    f"and vocabulary), or {', '.join(PARSERS)} (default: the config's inference.reasoning_parser)"
)
TOOL_CALL_PARSER_HELP = (
    "how chat replies' tool calls are read: auto (from the model's config and vocabulary), none (requests with "
    f"tools get 400), or {', '.join(FORMATS)} (default: the config's inference.tool_call_parser)"
)
