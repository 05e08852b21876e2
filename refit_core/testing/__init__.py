"""The plugin conformance kit: every check a refit backend must pass, run with its own factories.

A plugin author describes the backend once, as a :class:`Conformance` (model cases, layouts to check
from metadata, refusals, and factories that build a model on a rank), then::

    from refit_core.testing import check_plugin
    check_plugin(SUITE)            # raises ConformanceError listing every failed check

or, in pytest, subclasses :class:`PluginConformance` (loaded on first use: it imports pytest).
``refit check-plugin NAME`` runs the model-free part from the command line (a plugin publishes its
suite under the entry-point group ``refit.conformance``).

The checks: the plugin registers its backend; every hook answers None for foreign models and
backend names (so the owner's answer wins); metadata-only layouts plan against a reference
checkpoint (names, shapes, full coverage, no overlap); refusals raise ``PluginError``; live pieces
equal the metadata-only ones (names, boxes, dtypes, order); destination views never share memory;
begin / abort / finish behave as documented; and multi-process round trips against a reference side
land the reference state dict bit for bit, over two steps, with the plan ``refit plan`` predicts.

Import every name from here (``__all__``); the submodules are internal paths.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from refit_core.testing.live import round_trip, round_trips
from refit_core.testing.reference import (
    REFERENCE_BACKEND,
    ReferenceEngine,
    ReferencePlugin,
    ReferenceTrainer,
    reference_weights,
)
from refit_core.testing.results import CheckResult, ConformanceError, Outcome, require
from refit_core.testing.runner import check_plugin, installed_suite, model_free_suite
from refit_core.testing.static import model_free_checks
from refit_core.testing.suite import (
    Conformance,
    GenFactory,
    ModelCase,
    RankContext,
    Refusal,
    RoundTrip,
    Side,
    TrainFactory,
)

if TYPE_CHECKING:
    from refit_core.testing.pytest_plugin import PluginConformance

__all__ = [
    "REFERENCE_BACKEND", "CheckResult", "Conformance", "ConformanceError", "GenFactory", "ModelCase", "Outcome",
    "PluginConformance", "RankContext", "ReferenceEngine", "ReferencePlugin", "ReferenceTrainer", "Refusal",
    "RoundTrip", "Side", "TrainFactory", "check_plugin", "installed_suite", "model_free_checks", "model_free_suite",
    "reference_weights", "require", "round_trip", "round_trips",
]


def __getattr__(name: str) -> Any:
    """:class:`PluginConformance`, whose module imports pytest, on first access only."""
    if name == "PluginConformance":
        return importlib.import_module("refit_core.testing.pytest_plugin").PluginConformance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
