"""Running a suite: everything at once, or the model-free part of an installed plugin's suite."""

from __future__ import annotations

import importlib.metadata
from dataclasses import replace

from refit_core.contract.errors import PluginError
from refit_core.contract.plugins import PluginManager
from refit_core.contract.side import Side
from refit_core.kit.demo import installed_demos
from refit_core.kit.models import load_config
from refit_core.testing.live import round_trips
from refit_core.testing.results import CheckResult, require
from refit_core.testing.static import model_free_checks
from refit_core.testing.suite import Conformance, ModelCase

SUITE_GROUP = "refit.conformance"
"""Entry-point group under which a plugin publishes its :class:`Conformance` (same name as its plugin)."""


def check_plugin(suite: Conformance, *, live: bool = True, timeout_s: float = 300.0) -> list[CheckResult]:
    """Run every check of ``suite`` (``live=False``: only the model-free ones); raise
    :class:`~refit_core.testing.results.ConformanceError` if any fails, else return the results."""
    results = model_free_checks(suite)
    if live:
        results += round_trips(suite, timeout_s)
    return require(results)


def installed_suite(plugin: str) -> Conformance | None:
    """The suite an installed plugin publishes under ``refit.conformance``, or None if it publishes none."""
    for ep in importlib.metadata.entry_points(group=SUITE_GROUP):
        if ep.name == plugin:
            suite = ep.load()
            if not isinstance(suite, Conformance):
                raise PluginError(f"entry point {SUITE_GROUP}:{plugin} ({ep.value}) is a {type(suite).__name__}, "
                                  "not a refit_core.testing.Conformance")
            return suite
    return None


def model_free_suite(plugin: str, models: list[str], train_layouts: list[str] | None = None,
                     gen_layouts: list[str] | None = None) -> Conformance:
    """The suite ``refit check-plugin`` runs: the plugin's published one (minus its factories), with
    models and layouts replaced where given; plugins publishing none get one per backend they register
    (their demo layouts and a single rank, on the given models)."""
    suite = installed_suite(plugin)
    if suite is None:
        pm = PluginManager()
        info = next((p for p in pm.plugins if p.name == plugin), None)
        if info is None or not info.backends:
            raise PluginError(f"no installed refit plugin named {plugin!r} registers a backend")
        backend = info.backends[0]
        demo = installed_demos(pm).of(backend.name)
        suite = Conformance(plugin, backend.name, models=(),
                            train_layouts=("", demo.train_layout) if Side.TRAIN in backend.sides else (),
                            gen_layouts=("", demo.gen_layout) if Side.GEN in backend.sides else ())
    changes: dict = {"train": None, "gen": None, "round_trips": ()}
    if models:
        changes["models"] = tuple(ModelCase(m, load_config(m)) for m in models)
    elif not suite.models:
        changes["models"] = (ModelCase.preset("tiny-llama"), ModelCase.preset("tiny-qwen3-moe"))
    if train_layouts is not None:
        changes["train_layouts"] = tuple(train_layouts)
    if gen_layouts is not None:
        changes["gen_layouts"] = tuple(gen_layouts)
    suite = replace(suite, **changes)
    return replace(suite, train_layouts=tuple(dict.fromkeys(suite.train_layouts)),
                   gen_layouts=tuple(dict.fromkeys(suite.gen_layouts)))
