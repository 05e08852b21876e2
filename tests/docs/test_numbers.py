"""The docs' headline numbers are what the latest results say (``scripts/render-numbers.py --check``), and a
headline figure written without its marker fails."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _renderer() -> ModuleType:
    name = "render_numbers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts/render-numbers.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


rn = _renderer()


def test_every_page_shows_what_the_latest_results_say() -> None:
    problems = rn.check(rn.load_registry())
    assert not problems, "\n".join(f"{p.page}: {p.text}" for p in problems) + \
        "\nrun: python scripts/render-numbers.py"


def test_every_guarded_page_has_marked_numbers() -> None:
    registry = rn.load_registry()
    for page in {g.page for g in registry.guards}:
        assert page in registry.pages
        assert rn.MARKED.search((ROOT / page).read_text()), page


def _one_page(tmp_path: Path, page: str, text: str) -> tuple[object, Path]:
    (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / page).write_text(text)
    return dataclasses.replace(rn.load_registry(), pages=(page,)), tmp_path


def test_a_stale_number_fails(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    marker = "<!-- number: pair.llama.refit.ratio -->"
    now = rn.value("pair.llama.refit.ratio", "README.md", rn.load_registry())
    stale = text.replace(f"{marker}{now}<", f"{marker}0.123<")
    assert stale != text
    registry, root = _one_page(tmp_path, "README.md", stale)
    problems = rn.check(registry, root)
    assert [p.text for p in problems] == [f"pair.llama.refit.ratio: the page says 0.123, the results {now}"]


def test_an_unmarked_headline_figure_fails(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    bare = rn.MARKED.sub(lambda m: m["value"], text)
    registry, root = _one_page(tmp_path, "README.md", bare)
    problems = rn.check(registry, root)
    assert len(problems) == 4 and all("unmarked figure" in p.text for p in problems)


def _bench(machine: str, ratio: float) -> dict[str, object]:
    """A ``refit bench`` JSON of the pair kind, cut to what the renderer reads."""
    registry = rn.load_registry()
    kind = registry.kinds["pair"]
    rows = [{"method": m, "ratio_to_wire": ratio if m == "refit" else 0.5, "time_s": 0.05} for m in kind.methods]
    return {"machine": machine, "date": "x", "settings": {"train_tp": 1, "gen_tp": 1, "gen_dp": 1},
            "models": [{"model": registry.models[m], "fp8_block": None, "rows": rows} for m in kind.models]}


def test_the_latest_file_of_a_kind_gives_the_number(tmp_path: Path) -> None:
    registry = rn.load_registry()
    for name, machine, ratio in [("nvidia-h200-x2-bench-2026-11-27.json", "nvidia-h200-x2", 0.9811),
                                 ("nvidia-h200-x4-bench-2026-11-28.json", "nvidia-h200-x4", 0.9834),
                                 ("nvidia-h100-x2-bench-2026-11-29.json", "nvidia-h100-x2", 0.5)]:
        (tmp_path / name).write_text(json.dumps(_bench(machine, ratio)))
    shutil.copy(ROOT / "benchmarks/results/README.md", tmp_path / "README.md")  # not JSON: ignored
    assert rn.latest(registry.kinds["pair"], registry, tmp_path).path.name == "nvidia-h200-x4-bench-2026-11-28.json"
    assert rn.value("pair.llama.refit.ratio", "README.md", registry, tmp_path) == "0.983"
    assert rn.value("pair.@link", "docs/benchmarks.md", registry, tmp_path) == (
        "[nvidia-h200-x4-bench-2026-11-28](results/nvidia-h200-x4-bench-2026-11-28.md)")
