"""CHANGELOG.md stays readable: releases newest first, each with only Added / Changed / Fixed / Removed
and nothing but bullets in them; and every commit subject since d97d313 fits 72 characters."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.environments import BY_DESIGN

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "CHANGELOG.md"
SECTIONS = ("Added", "Changed", "Fixed", "Removed")
RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)(?: \(unreleased\))?")
SUBJECTS_SINCE = "d97d313"
"""The commit after which subjects are held to :data:`MAX_SUBJECT` (the rule came with issue #46)."""
MAX_SUBJECT = 72


@dataclass(frozen=True)
class Release:
    """One ``## X.Y.Z`` section: its heading's line number, its version, and its body's numbered lines."""

    line: int
    version: tuple[int, ...] | None
    body: tuple[tuple[int, str], ...]


def releases(text: str) -> list[Release]:
    """The ``## `` sections of a changelog, in file order; a heading that is not a version has ``version`` None."""
    found: list[Release] = []
    heading: tuple[int, str] | None = None
    body: list[tuple[int, str]] = []
    for number, line in [*enumerate(text.splitlines(), 1), (0, "## end")]:
        if line.startswith("## "):
            if heading is not None:
                match = RELEASE.fullmatch(heading[1])
                version = tuple(int(part) for part in match.groups()) if match else None
                found.append(Release(heading[0], version, tuple(body)))
            heading, body = (number, line[3:].strip()), []
        elif heading is not None:
            body.append((number, line))
    return found


def order_problems(text: str) -> list[str]:
    """Headings that are no version, and releases not strictly newer than the one below them."""
    found = releases(text)
    problems = [f"line {r.line}: '## ' heading is not a release version" for r in found if r.version is None]
    versions = [(r.line, r.version) for r in found if r.version is not None]
    problems += [f"line {below[0]}: {below[1]} is not older than {above[1]} above it"
                 for above, below in zip(versions, versions[1:]) if not below[1] < above[1]]
    return problems if found else ["no '## X.Y.Z' release at all"]


def section_problems(text: str) -> list[str]:
    """Subsections other than Added / Changed / Fixed / Removed, repeated ones, and deeper headings."""
    problems = []
    for release in releases(text):
        seen: set[str] = set()
        for number, line in release.body:
            if line.startswith("### ") and line[4:].strip() in SECTIONS:
                name = line[4:].strip()
                if name in seen:
                    problems.append(f"line {number}: a second '### {name}' in one release")
                seen.add(name)
            elif line.startswith("#"):
                problems.append(f"line {number}: {line!r} is not one of {', '.join(SECTIONS)}")
    return problems


def prose_problems(text: str) -> list[str]:
    """Lines of a release that are neither a heading, a bullet under a subsection, nor a bullet's continuation."""
    problems = []
    for release in releases(text):
        in_section = in_bullet = False
        for number, line in release.body:
            if not line.strip():
                in_bullet = False
            elif line.startswith("#"):
                in_section, in_bullet = True, False
            elif line.startswith("- ") and in_section:
                in_bullet = True
            elif not (line.startswith("  ") and in_bullet):
                problems.append(f"line {number}: prose outside a bullet: {line[:60]!r}")
    return problems


def test_releases_are_newest_first():
    assert order_problems(CHANGELOG.read_text()) == []


def test_releases_have_only_the_four_sections():
    assert section_problems(CHANGELOG.read_text()) == []


def test_releases_hold_only_bullets():
    assert prose_problems(CHANGELOG.read_text()) == []


GOOD = "# Changelog\n\nPreamble.\n\n## 0.2.0 (unreleased)\n\n### Added\n- a\n  b\n  - c\n\n## 0.1.0\n\n### Fixed\n- d\n"


@pytest.mark.parametrize("check, planted", [
    (order_problems, GOOD.replace("## 0.1.0", "## 0.10.0")),
    (order_problems, GOOD.replace("## 0.1.0", "## Unreleased")),
    (section_problems, GOOD.replace("### Fixed", "### Security")),
    (section_problems, GOOD.replace("### Fixed", "### Added\n- e\n### Added")),
    (section_problems, GOOD.replace("### Fixed", "### Fixed\n#### refit-core")),
    (prose_problems, GOOD.replace("### Added\n", "A sentence.\n\n### Added\n")),
    (prose_problems, GOOD.replace("  b\n", "\n  b\n")),
    (prose_problems, GOOD.replace("### Fixed\n", "")),
])
def test_each_check_fails_on_a_planted_defect(check, planted):
    assert check(GOOD) == []
    assert check(planted) != []


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


def test_commit_subjects_since_the_rule_fit():
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip(f"{BY_DESIGN}not a git checkout")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip(f"{BY_DESIGN}a shallow clone may lack commit {SUBJECTS_SINCE}")
    if _git("merge-base", "--is-ancestor", SUBJECTS_SINCE, "HEAD").returncode != 0:
        pytest.skip(f"{BY_DESIGN}commit {SUBJECTS_SINCE} is not in this clone's history of HEAD")
    log = _git("log", "--format=%h %s", f"{SUBJECTS_SINCE}..HEAD")
    assert log.returncode == 0, log.stderr
    long = [line for line in log.stdout.splitlines() if len(line.split(" ", 1)[1]) > MAX_SUBJECT]
    assert not long, f"commit subjects over {MAX_SUBJECT} characters: {long}"
