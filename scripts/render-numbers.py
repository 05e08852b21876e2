"""Render the docs' headline numbers from ``benchmarks/results/``: every number a page writes between
``<!-- number: ID -->`` and ``<!-- /number -->`` is filled from the latest results file of its kind, as
``scripts/numbers.toml`` says.

    python scripts/render-numbers.py            # rewrite the pages
    python scripts/render-numbers.py --check    # exit 1 and say what differs, or which figure is unmarked
    python scripts/render-numbers.py --list     # every number, its value and its source file
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results"
REGISTRY = Path(__file__).with_name("numbers.toml")
MARKED = re.compile(r"<!-- number: (?P<id>[^ ]+) -->(?P<value>.*?)<!-- /number -->")
DATE = re.compile(r"\d{4}-\d\d-\d\d")
RATIO = re.compile(r"(?<![\d.])0\.\d{2,3}(?!\d|\.\d)")  # 0.981, not a version such as 0.16.1


@dataclass(frozen=True)
class Kind:
    """Which results files count for a kind of number: one reader's files on one machine (a prefix),
    in one layout, holding every listed model and method, and, if given, named as ``name`` says."""

    name: str
    reader: str
    machine: str
    models: tuple[str, ...]
    methods: tuple[str, ...]
    layout: tuple[int, ...] | None = None
    pattern: str = r".*\.json$"


@dataclass(frozen=True)
class Field:
    """How one value is read from a method's row: its key, a scale and a format."""

    key: str
    scale: float = 1.0
    format: str = ".3f"


@dataclass(frozen=True)
class Guard:
    """A passage of a page in which every ratio must be a marked number."""

    page: str
    start: str
    end: str


@dataclass(frozen=True)
class Registry:
    """``numbers.toml``: the pages, the model aliases, the kinds, the fields per reader and the guards."""

    pages: tuple[str, ...]
    models: dict[str, str]
    kinds: dict[str, Kind]
    fields: dict[str, dict[str, Field]]
    guards: tuple[Guard, ...]


@dataclass(frozen=True)
class Source:
    """A results file and its JSON."""

    path: Path
    doc: Any

    @property
    def date(self) -> str:
        """The date in its file name."""
        return DATE.search(self.path.name).group(0)


@dataclass(frozen=True)
class Problem:
    """Something a page says that the results do not: a stale or unknown number, or an unmarked one."""

    page: str
    text: str


def load_registry(path: Path = REGISTRY) -> Registry:
    """The registry in ``path``."""
    raw = tomllib.loads(path.read_text())
    kinds = {name: Kind(name, k["reader"], k["machine"], tuple(k["models"]), tuple(k["methods"]),
                        tuple(k["layout"]) if "layout" in k else None, k.get("name", Kind.pattern))
             for name, k in raw["kinds"].items()}
    fields = {reader: {name: Field(**f) for name, f in table.items()} for reader, table in raw["fields"].items()}
    guards = tuple(Guard(**g) for g in raw["guards"])
    return Registry(tuple(raw["pages"]), dict(raw["models"]), kinds, fields, guards)


def _bench_rows(doc: dict[str, Any], fp8: bool) -> dict[tuple[str, str], dict[str, Any]]:
    """A ``refit bench`` run's rows by (model, method): the BF16 models', or the FP8 ones' with the run's
    FP8 summary of that model merged in."""
    if "models" not in doc or "settings" not in doc or fp8 != bool(doc.get("fp8")):
        return {}
    extra = {e["model"]: e for e in doc.get("fp8", [])}
    return {(m["model"], r["method"]): {**extra.get(m["model"], {}), **r}
            for m in doc["models"] if bool(m.get("fp8_block")) == fp8 for r in m["rows"]}


def _colocated_rows(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """A colocated run's rows by (model, method)."""
    if not isinstance(doc, dict) or "rows" not in doc or "of_bound" not in (doc["rows"] or [{}])[0]:
        return {}
    return {(r["model"], r["method"]): r for r in doc["rows"]}


def _megatron_rows(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """A ``benchmarks/megatron_gpu.sh`` run's rows (a real megatron-core model) by (model, NCCL setting)."""
    if not isinstance(doc, dict) or doc.get("source") != "megatron":
        return {}
    return {(doc["model"], str(run.get("nccl"))): run for run in doc.get("runs", [])}


READERS: dict[str, Callable[[Any], dict[tuple[str, str], dict[str, Any]]]] = {
    "bench": lambda doc: _bench_rows(doc, fp8=False),
    "bench-fp8": lambda doc: _bench_rows(doc, fp8=True),
    "colocated": _colocated_rows,
    "megatron": _megatron_rows,
}


def machine_of(doc: dict[str, Any]) -> str:
    """The machine a run names, or, for runs that do not, the one its environment describes."""
    if doc.get("machine"):
        return str(doc["machine"])
    env = doc.get("environment") or {}
    gpu = str(env.get("gpu", "")).lower().replace(" ", "-")
    return f"{gpu}-x{env['gpus']}" if gpu and env.get("gpus", 1) > 1 else gpu


def _layout(doc: dict[str, Any]) -> tuple[int, ...]:
    s = doc.get("settings", {})
    return (s.get("train_tp"), s.get("gen_tp"), s.get("gen_dp"))


@cache
def _sources(results: Path) -> tuple[Source, ...]:
    """Every dated JSON results file under ``results``."""
    return tuple(Source(p, json.loads(p.read_text())) for p in sorted(results.glob("*.json")) if DATE.search(p.name))


def _order(source: Source) -> tuple[str, str, str]:
    run_date = source.doc.get("date", "") if isinstance(source.doc, dict) else ""
    return (source.date, str(run_date), source.path.name)


def matches(kind: Kind, source: Source, registry: Registry) -> bool:
    """Whether ``source`` is a result of ``kind``."""
    doc = source.doc
    if not re.search(kind.pattern, source.path.name) or not isinstance(doc, dict):
        return False
    if not machine_of(doc).startswith(kind.machine):
        return False
    if kind.layout is not None and _layout(doc) != kind.layout:
        return False
    rows = READERS[kind.reader](doc)
    return all((registry.models[m], method) in rows for m in kind.models for method in kind.methods)


def latest(kind: Kind, registry: Registry, results: Path = RESULTS) -> Source:
    """The latest results file of ``kind``."""
    found = [s for s in _sources(results) if matches(kind, s, registry)]
    if not found:
        raise LookupError(f"no results file of kind {kind.name!r} under {results}")
    return max(found, key=_order)


def _link(source: Source, page: str) -> str:
    """A link from ``page`` to the source's markdown: through ``docs/results`` from a page under docs/."""
    stem = source.path.with_suffix(".md").name
    base = ROOT / ("docs/results" if page.startswith("docs/") else "benchmarks/results")
    return f"[{source.path.stem}]({os.path.relpath(base / stem, (ROOT / page).parent)})"


def value(number: str, page: str, registry: Registry, results: Path = RESULTS) -> str:
    """The text of marked number ``number`` on ``page``: ``KIND.@link``, ``KIND.@date``, ``KIND.@machine``
    or ``KIND.MODEL.METHOD.FIELD``."""
    kind_name, _, rest = number.partition(".")
    if kind_name not in registry.kinds:
        raise KeyError(f"{number}: no kind {kind_name!r} in {REGISTRY.name}")
    kind = registry.kinds[kind_name]
    source = latest(kind, registry, results)
    if rest == "@link":
        return _link(source, page)
    if rest == "@date":
        return source.date
    if rest == "@machine":
        return f"`{machine_of(source.doc)}`"
    parts = rest.split(".")
    if len(parts) != 3:
        raise KeyError(f"{number}: not KIND.MODEL.METHOD.FIELD, KIND.@link, KIND.@date or KIND.@machine")
    model, method, field_name = parts
    field = registry.fields[kind.reader].get(field_name)
    if model not in registry.models or field is None:
        raise KeyError(f"{number}: unknown model {model!r} or field {field_name!r} (reader {kind.reader})")
    row = READERS[kind.reader](source.doc).get((registry.models[model], method))
    if row is None or row.get(field.key) is None:
        raise KeyError(f"{number}: {source.path.name} has no {field.key} for {model} / {method}")
    return format(row[field.key] * field.scale, field.format)


def render(text: str, page: str, registry: Registry, results: Path = RESULTS) -> str:
    """``text`` with every marked number filled in."""
    def fill(found: re.Match[str]) -> str:
        return f"<!-- number: {found['id']} -->{value(found['id'], page, registry, results)}<!-- /number -->"
    return MARKED.sub(fill, text)


def unmarked(text: str, guard: Guard) -> list[str]:
    """The ratios in ``guard``'s passage of ``text`` that are not marked numbers (or why the passage is
    missing)."""
    start = text.find(guard.start)
    if start < 0:
        return [f"the guarded passage starting {guard.start!r} is gone: update {REGISTRY.name}"]
    end = text.find(guard.end, start + len(guard.start))
    passage = MARKED.sub("", text[start:end if end >= 0 else len(text)])
    passage = re.sub(r"\]\([^)]*\)", "]", passage)  # link targets: file names, not figures
    return [f"unmarked figure {m.group(0)} in the passage starting {guard.start!r}" for m in RATIO.finditer(passage)]


def check(registry: Registry, root: Path = ROOT, results: Path = RESULTS) -> list[Problem]:
    """Every page whose marked numbers differ from what the results say, and every unmarked guarded
    figure."""
    problems = []
    for page in registry.pages:
        text = (root / page).read_text()
        try:
            fresh = render(text, page, registry, results)
        except (KeyError, LookupError) as exc:
            problems.append(Problem(page, str(exc)))
            continue
        old = {(m.start(), m["id"]): m["value"] for m in MARKED.finditer(text)}
        new = [m["value"] for m in MARKED.finditer(fresh)]
        for ((_, number), was), now in zip(old.items(), new):
            if was != now:
                problems.append(Problem(page, f"{number}: the page says {was}, the results {now}"))
        for guard in (g for g in registry.guards if g.page == page):
            problems += [Problem(page, figure) for figure in unmarked(text, guard)]
    return problems


def write(registry: Registry, root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """Rewrite every page whose numbers changed; the pages rewritten."""
    changed = []
    for page in registry.pages:
        path = root / page
        text = path.read_text()
        fresh = render(text, page, registry, results)
        if fresh != text:
            path.write_text(fresh)
            changed.append(page)
    return changed


def listing(registry: Registry, root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """One line per marked number: page, ID, value and source file."""
    lines = []
    for page in registry.pages:
        for m in MARKED.finditer((root / page).read_text()):
            kind = registry.kinds.get(m["id"].partition(".")[0])
            source = latest(kind, registry, results).path.name if kind else "?"
            lines.append(f"{page}: {m['id']} = {value(m['id'], page, registry, results)}  ({source})")
    return lines


def main(argv: list[str] | None = None) -> int:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is stale")
    parser.add_argument("--list", action="store_true", help="print every number with its source")
    args = parser.parse_args(argv)
    registry = load_registry()
    if args.list:
        print("\n".join(listing(registry)))
        return 0
    if args.check:
        problems = check(registry)
        for p in problems:
            print(f"{p.page}: {p.text}")
        if problems:
            print("run: python scripts/render-numbers.py (then mark any unmarked figure)")
        return 1 if problems else 0
    for page in write(registry):
        print(f"rendered {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
