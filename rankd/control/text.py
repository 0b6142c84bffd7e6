"""Text that is not valid Unicode (lone surrogates): found, named in errors, or replaced by U+FFFD.

A Python ``str`` can hold surrogate code points (U+D800-U+DFFF) that no UTF-8 text can: a
``"\\ud800"`` JSON escape in a notebook cell or a saved conversation, or bytes that are not
UTF-8 decoded with ``errors="surrogateescape"`` (Python's choice for stdin under a C or POSIX
locale). Tokenizers and encoders refuse such text, so text is checked or cleaned here before
it reaches one: requests are refused with a clear error, input and output get U+FFFD.
"""

from __future__ import annotations

import codecs
import re
from typing import Any

REPLACEMENT = "\ufffd"
SURROGATES = re.compile("[\ud800-\udfff]")
REPLACE_ERRORS = "shardbook.replace_surrogates"
"""A codec error handler for UTF-8 encoding: one U+FFFD where each unencodable character was."""


def _replace_unencodable(error: UnicodeError) -> tuple[bytes, int]:
    if not isinstance(error, UnicodeEncodeError) or error.encoding not in ("utf-8", "utf8"):
        raise error
    # bytes, not str: CPython's UTF-8 encoder takes only ASCII text from an error handler
    return REPLACEMENT.encode() * (error.end - error.start), error.end


codecs.register_error(REPLACE_ERRORS, _replace_unencodable)


def first_invalid(text: str) -> int | None:
    """The index of the first surrogate code point in ``text`` (None when it is valid Unicode)."""
    match = SURROGATES.search(text)
    return None if match is None else match.start()


def replace_invalid(text: str) -> tuple[str, int]:
    """``text`` with every surrogate code point replaced by U+FFFD, and how many were replaced."""
    return SURROGATES.subn(REPLACEMENT, text)


def check_valid(text: str, what: str) -> None:
    """Raise ValueError naming ``what`` and the position when ``text`` is not valid Unicode."""
    index = first_invalid(text)
    if index is not None:
        raise ValueError(
            f"{what} is not valid Unicode text: it holds the lone surrogate U+{ord(text[index]):04X} at character "
            f"{index} (from a '\\ud800'-style escape, or from bytes that were not UTF-8). Remove it, or decode the "
            "text with errors='replace'"
        )


def clean(value: Any) -> Any:
    """``value`` (str, or dicts and lists of them) with every surrogate code point replaced by U+FFFD."""
    if isinstance(value, str):
        return replace_invalid(value)[0]
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value
