"""Every link and file path written in README.md and docs/*.md points at something in the repository.

Relative links (markdown links and images) must resolve to a file or folder, and an anchor
(`page.md#heading`, `#heading`) must match a heading of its target by GitHub's slug rules. A
backticked path whose first part is a top-level entry of the repository (`rankd/control/dispatch.py`,
`bench/bench_decode.py`, `.ci/setup`, `notebooks/`) must exist.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
PATH = re.compile(r"^[\w.-]+(?:/[\w.*-]+)+/?$|^[\w.-]+/$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, heading in HEADING.findall(without_code_blocks(page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(without_code_blocks(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    return broken


def repo_roots() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {line.split("/", 1)[0] for line in files.splitlines() if "/" in line}


def missing_paths(page: Path, roots: set[str]) -> list[str]:
    missing = []
    text = without_code_blocks(page.read_text())
    for _, span in CODE_SPAN.findall(text):
        for token in span.split():
            token = token.rstrip(".,;:")
            if not PATH.match(token) or token.split("/", 1)[0] not in roots or "*" in token or "{" in token:
                continue
            if not (ROOT / token).exists():
                missing.append(token)
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_backticked_repository_path_exists(page):
    assert missing_paths(page, repo_roots()) == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A `code` heading, with punctuation!\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n[ok](other.md#a-code-heading-with-punctuation) [self](#page) ![img](missing.png)\n"
        "[bad anchor](other.md#nope) [gone](gone.md)\n```\n[in a code block](ignored.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.png: no such file",
        "other.md#nope: no heading with the anchor #nope",
        "gone.md: no such file",
    ]
    page.write_text("`rankd/control/dispatch.py` `rankd/handlers.py` `bench/` `~/.shardbook/job.key` `a.b.c`\n")
    assert missing_paths(page, {"rankd", "bench"}) == ["rankd/handlers.py"]
