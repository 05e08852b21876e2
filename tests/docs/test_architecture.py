"""docs/architecture.md stays true: every module of refit_core is in its folder's row, and the count is right."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/architecture.md"
PACKAGE = ROOT / "refit_core"


def _rows() -> dict[str, str]:
    """The module table's rows: folder (``plan/``, ``refit_core/`` for the top) -> its text."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        found = re.match(r"\| `([a-z_/]+/)` \| (.*) \|$", line)
        if found:
            rows[found.group(1)] = found.group(2)
    return rows


def test_every_module_is_in_its_folders_row():
    rows = _rows()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = path.parent.relative_to(PACKAGE).as_posix()
        row = rows.get("refit_core/" if folder == "." else f"{folder}/")
        if path.name == "__init__.py" and folder != "apps":
            continue  # a package's face: its folder's row stands for it
        if row is None or f"`{path.name}`" not in row:
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"docs/architecture.md does not list these modules in their folder's row: {missing}"


def test_the_module_count_is_current():
    stated = re.search(r"`refit_core` has \*\*(\d+) modules\*\*", PAGE.read_text())
    assert stated, "docs/architecture.md no longer states the module count"
    assert int(stated.group(1)) == len(list(PACKAGE.rglob("*.py")))


def test_the_layers_picture_is_there():
    assert (ROOT / "docs/images/layers.png").stat().st_size > 10_000
