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

A transport is checked the same way: :func:`check_transport` (``refit_core.testing.transport``).

Import every name from here (``__all__``); the submodules are internal paths. Names that left ``__all__`` still
import until refit 0.3, with a :class:`DeprecationWarning` naming their new place (:data:`MOVED`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refit_core import _compat
from refit_core.testing.runner import check_plugin
from refit_core.testing.suite import Conformance, GenFactory, ModelCase, RankContext, Refusal, RoundTrip, TrainFactory

if TYPE_CHECKING:
    from refit_core.testing.pytest_plugin import PluginConformance
    from refit_core.testing.transport import check_transport

__all__ = [
    "Conformance", "GenFactory", "ModelCase", "PluginConformance", "RankContext", "Refusal", "RoundTrip",
    "TrainFactory", "check_plugin", "check_transport",
]

LAZY = {"PluginConformance": "refit_core.testing.pytest_plugin", "check_transport": "refit_core.testing.transport"}
"""Names loaded on first access: ``PluginConformance`` imports pytest, ``check_transport`` the transports."""

_RESULTS = "check_plugin raises it (an AssertionError) listing every failed check"
_REFERENCE = "the kit runs the reference side itself (Conformance round_trips)"
_RUNNER = "check_plugin runs the whole suite"
MOVED: dict[str, tuple[str, str]] = {
    # name: (module holding it, where to take it from now)
    "Side": ("refit_core.contract.side", "import it from refit_core"),
    "ConformanceError": ("refit_core.testing.results", _RESULTS),
    "CheckResult": ("refit_core.testing.results", _RESULTS),
    "Outcome": ("refit_core.testing.results", _RESULTS),
    "require": ("refit_core.testing.results", _RESULTS),
    "REFERENCE_BACKEND": ("refit_core.testing.reference", _REFERENCE),
    "ReferenceEngine": ("refit_core.testing.reference", _REFERENCE),
    "ReferencePlugin": ("refit_core.testing.reference", _REFERENCE),
    "ReferenceTrainer": ("refit_core.testing.reference", _REFERENCE),
    "reference_weights": ("refit_core.testing.reference", _REFERENCE),
    "round_trip": ("refit_core.testing.live", _RUNNER),
    "round_trips": ("refit_core.testing.live", _RUNNER),
    "installed_suite": ("refit_core.testing.runner", _RUNNER),
    "model_free_suite": ("refit_core.testing.runner", _RUNNER),
    "model_free_checks": ("refit_core.testing.static", _RUNNER),
}
"""Names that left ``__all__`` (refit 0.3's smaller surface): where each lives, and what to use instead."""

__getattr__ = _compat.moved_names(__name__, MOVED, lazy=LAZY)
