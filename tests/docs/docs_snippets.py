"""The Python blocks of the documentation: which run, where, and why the others do not.

A fenced ```` ```python ```` block runs with its page (:func:`run_page`) unless the line right before
it (blank lines aside) is a marker:

- ``<!-- not-run: REASON -->``: not run; the reason must say why (a GPU, a peer's framework, a fragment...);
- ``<!-- run-with: HARNESS -->``: run by the test :data:`HARNESSES` names, in the namespace that test
  provides (a real engine, train ranks...), not with its page.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not-run|run-with):\s*(?P<value>.*?)\s*-->\s*$")
MIN_REASON_WORDS = 3

HARNESSES: dict[str, str] = {
    "vllm-engine": "tests/vllm/test_vllm_docs.py",
    "vllm-trainer": "tests/vllm/test_vllm_docs.py",
    "sglang-trainer": "tests/sglang/test_sglang_docs.py",
    "ray-controller": "tests/ray/test_ray_refit.py",
    "verl-switch": "tests/docs/verl_switch.py",
}
"""Every ``run-with`` harness, and the test (or the program a test runs) that runs its blocks; its
docstring says what the blocks find in their namespace."""


@dataclass(frozen=True)
class Snippet:
    """One Python block: where it is, its code, ``reason`` why it is not run (None: it runs) and the
    ``harness`` that runs it (None: its page's run)."""

    page: str
    line: int
    code: str
    reason: str | None
    harness: str | None = None

    @property
    def runs(self) -> bool:
        """True: it runs with its page (:func:`run_page`); False: not at all, or by its harness."""
        return self.reason is None and self.harness is None

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
            code = textwrap.dedent("\n".join(lines[i + 1:end]))
            out.append(Snippet(page, i + 2, code, *_marker(before, f"{page}:{i + 1}")))
        i = end + 1
    return out


def _marker(line: str, where: str) -> tuple[str | None, str | None]:
    """(reason, harness) of the marker ``line`` (both None: no marker)."""
    marker = MARKER.match(line)
    if marker is None:
        return None, None
    value = marker["value"]
    if marker["kind"] == "run-with":
        if value not in HARNESSES:
            raise ValueError(f"{where}: no harness {value!r} runs blocks (known: {', '.join(sorted(HARNESSES))})")
        return None, value
    if len(value.split()) < MIN_REASON_WORDS:
        raise ValueError(f"{where}: a not-run marker must say why (got {value!r})")
    return value, None


def pages() -> list[Path]:
    """Every page of the site, and the README."""
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def page_snippets(path: Path) -> list[Snippet]:
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return snippets(path.read_text(), name)


def harness_snippets(path: Path, harness: str) -> list[Snippet]:
    """The blocks of one page that ``harness`` runs, in order."""
    return [s for s in page_snippets(path) if s.harness == harness]


def run_snippet(snippet: Snippet, namespace: dict) -> None:
    """Execute one block in ``namespace`` (tracebacks name the page and line)."""
    exec(compile(snippet.code, snippet.where, "exec"), namespace)


def run_page(path: Path) -> int:
    """Run a page's runnable blocks in order, in one namespace (a block may use what an earlier one
    defined); returns how many ran."""
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for snippet in page_snippets(path):
        if snippet.runs:
            run_snippet(snippet, namespace)
            ran += 1
    return ran
