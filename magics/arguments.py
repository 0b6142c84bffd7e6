"""One way every magic reads its line: IPython's splitting, then one matching pair of quotes dropped from each word.

IPython's `parse_argstring` keeps the quotes of ``--modules "**"`` or ``--system "Be brief."``
as part of the value; every magic parses its line with `parse_line` instead, so a quoted value
means the same in each.
"""

from __future__ import annotations

import argparse

from IPython.utils.process import arg_split


def unquote(text: str) -> str:
    """`"Be brief."` -> `Be brief.`: one matching pair of surrounding quotes dropped."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def split_line(line: str) -> list[str]:
    """The words of a magic's line, quoted words as one word without their quotes."""
    return [unquote(word) for word in arg_split(line, strict=True)]


def parse_line(magic, line: str) -> argparse.Namespace:
    """What `parse_argstring(magic, line)` gives, with quotes dropped as `split_line` does."""
    return magic.parser.parse_args(split_line(line))
