"""The Python blocks of the documentation: which run, and why the others do not.

A fenced ```` ```python ```` block runs unless the line right before it (blank lines aside) is
``<!-- not-run: REASON -->``; the reason must say why (a GPU, a running engine, a fragment...).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<reason>.*?)\s*-->\s*$")
MIN_REASON_WORDS = 3


@dataclass(frozen=True)
class Snippet:
    """One Python block: where it is, its code, and ``reason`` why it is not run (None: it runs)."""

    page: str
    line: int
    code: str
    reason: str | None

    @property
    def runs(self) -> bool:
        return self.reason is None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def snippets(text: str, page: str) -> list[Snippet]:
    """The Python blocks of one Markdown page, in order."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a code block that never closes")
        if opened["lang"] == "python":
            before = next((line for line in reversed(lines[:i]) if line.strip()), "")
            marker = NOT_RUN.match(before)
            reason = marker["reason"] if marker else None
            if reason is not None and len(reason.split()) < MIN_REASON_WORDS:
                raise ValueError(f"{page}:{i + 1}: a not-run marker must say why (got {reason!r})")
            code = textwrap.dedent("\n".join(lines[i + 1:end]))
            out.append(Snippet(page, i + 2, code, reason))
        i = end + 1
    return out


def pages() -> list[Path]:
    """Every page of the site, and the README."""
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def page_snippets(path: Path) -> list[Snippet]:
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return snippets(path.read_text(), name)


def run_page(path: Path) -> int:
    """Run a page's runnable blocks in order, in one namespace (a block may use what an earlier one
    defined); returns how many ran."""
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for snippet in page_snippets(path):
        if snippet.runs:
            exec(compile(snippet.code, snippet.where, "exec"), namespace)
            ran += 1
    return ran
