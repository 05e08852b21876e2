"""Every ``pip install`` line of the docs installs something that exists (issue 45).

refit's packages are on no package index yet (docs/releasing.md), so an install line names them by
path: the wheels ``scripts/build-wheels.sh`` builds (``dist/refit_core-*.whl``, also as
``"$(ls dist/refit_core-*.whl)[ray]"`` with an extra) or a folder of this checkout (``-e plugins/vllm``),
never by name. Other packages by name (``vllm``, ``megatron-core==0.16.1``) are fine.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build-wheels.sh"
INSTALL = re.compile(r"pip install\b([^`#\n]*)")
WITH_VALUE = {"-r", "-c", "--target", "--index-url", "--extra-index-url", "--find-links", "--python"}
REQUIREMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
WHEEL = re.compile(r"dist/(?P<dist>[a-z0-9_]+)-\*\.whl(?:\[(?P<extras>[\w,]+)\])?")


@dataclass(frozen=True)
class Line:
    """One ``pip install`` of a page: where, and what follows ``install`` (up to a comment or a code span's end)."""

    where: str
    args: str


def pages() -> list[Path]:
    """The pages whose install lines users copy: the docs site (not its results, nor the release steps,
    which install from an index on purpose), the READMEs and the examples' docstrings."""
    docs = [p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts and p.name != "releasing.md"]
    return sorted([*docs, ROOT / "README.md", *ROOT.glob("plugins/*/README.md"), *ROOT.glob("examples/*.py")])


def install_lines() -> list[Line]:
    """Every ``pip install`` on :func:`pages`."""
    return [Line(f"{page.relative_to(ROOT)}:{number}", found.group(1))
            for page in pages() for number, text in enumerate(page.read_text().splitlines(), 1)
            for found in INSTALL.finditer(text)]


def built_wheels() -> dict[str, set[str]]:
    """What ``build-wheels.sh`` builds: each distribution's wheel name (``refit_plugin_vllm``) -> its extras."""
    projects = [ROOT / "pyproject.toml", *ROOT.glob("plugins/*/pyproject.toml")]
    out = {}
    for path in projects:
        project = tomllib.loads(path.read_text())["project"]
        out[project["name"].replace("-", "_")] = set(project.get("optional-dependencies", {}))
    return out


def problems(line: Line, wheels: dict[str, set[str]]) -> list[str]:
    """Why ``line`` would not install (empty: it would)."""
    out = []
    words = line.args.replace('"', " ").replace("'", " ").replace("$(ls ", "").replace(")[", "[").split()
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-e", "--editable"):
            i += 1
            folder = words[i].split("[")[0] if i < len(words) else ""
            if not (ROOT / folder / "pyproject.toml").is_file():
                out.append(f"-e {folder}: no package folder of this checkout")
        elif word in WITH_VALUE:
            i += 1
        elif word.startswith("dist/"):
            wheel = WHEEL.fullmatch(word)
            if wheel is None or wheel["dist"] not in wheels:
                out.append(f"{word}: build-wheels.sh builds no such wheel (it builds {sorted(wheels)})")
            elif wheel["extras"] and not set(wheel["extras"].split(",")) <= wheels[wheel["dist"]]:
                out.append(f"{word}: {wheel['dist']} has no such extra (it has {sorted(wheels[wheel['dist']])})")
        elif not word.startswith("-"):
            name = REQUIREMENT.match(word)
            if name is None:  # prose after the command
                break
            if name.group(0).lower().replace("-", "_") in wheels:
                out.append(f"{word}: no package index holds refit's packages yet; install the wheels of "
                           "scripts/build-wheels.sh by path (docs/install.md)")
        i += 1
    return out


def test_every_install_line_installs_what_exists():
    lines = install_lines()
    assert len(lines) >= 8, [line.where for line in lines]
    wheels = built_wheels()
    assert {"refit_core", "refit_plugin_dtensor", "refit_plugin_vllm"} <= set(wheels)
    wrong = [f"{line.where}: pip install{line.args}: {why}" for line in lines for why in problems(line, wheels)]
    assert not wrong, "\n".join(wrong)


def test_the_install_page_builds_with_the_script_and_installs_by_path():
    page = (ROOT / "docs" / "install.md").read_text()
    assert "bash scripts/build-wheels.sh" in page and SCRIPT.is_file()
    script = SCRIPT.read_text()
    assert "plugins/*/" in script and "pip wheel" in script  # every plugin, as built_wheels() reads them
    assert "build-wheels.sh" in (ROOT / "scripts" / "check-wheels.sh").read_text()  # CI installs these wheels


def test_refit_packages_by_name_are_refused():
    wheels = {"refit_core": {"ray"}, "refit_plugin_vllm": set()}
    assert problems(Line("x", " refit-core refit-plugin-vllm"), wheels) == [
        "refit-core: no package index holds refit's packages yet; install the wheels of scripts/build-wheels.sh "
        "by path (docs/install.md)",
        "refit-plugin-vllm: no package index holds refit's packages yet; install the wheels of "
        "scripts/build-wheels.sh by path (docs/install.md)"]
    assert problems(Line("x", ' "$(ls dist/refit_core-*.whl)[ray]" dist/refit_plugin_vllm-*.whl vllm'), wheels) == []
    assert problems(Line("x", " --no-deps megatron-core==0.16.1   (then more prose)"), wheels) == []
    assert problems(Line("x", " dist/refit_core-*.whl[plot] -e plugins/nothing"), wheels) == [
        "dist/refit_core-*.whl[plot]: refit_core has no such extra (it has ['ray'])",
        "-e plugins/nothing: no package folder of this checkout"]
