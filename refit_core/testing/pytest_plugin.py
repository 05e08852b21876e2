"""refit's conformance kit as a pytest plugin (entry point ``pytest11: refit``; or
``pytest_plugins = ["refit_core.testing.pytest_plugin"]``).

Subclass :class:`PluginConformance` in a test module and set ``suite``::

    from refit_core.testing.pytest_plugin import PluginConformance
    from refit_mybackend.conformance import SUITE

    class TestMyBackendConformance(PluginConformance):
        suite = SUITE

pytest then runs the model-free checks as one test and every round trip (per side) as its own,
marked ``slow``. The module imports nothing heavy until a test runs, so loading it costs nothing
in test sessions that do not use it.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: a refit plugin conformance check (refit_core.testing)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``conformance_round_trip`` with the round trips of the test class's ``suite``."""
    if "conformance_round_trip" not in metafunc.fixturenames:
        return
    from refit_core.testing.suite import Side

    suite = getattr(metafunc.cls, "suite", None)
    if suite is None:
        raise pytest.UsageError(f"{metafunc.cls.__name__}: set `suite` to the plugin's Conformance")
    params = [pytest.param((trip, side), marks=pytest.mark.slow,
                           id=f"{side.value}-{trip.model.name}-{trip.layout or 'single'}")
              for trip in suite.round_trips for side in Side if suite.factory(side) is not None]
    if not params:
        # "by design: " marks a skip as intended (refit's own CI fails every other skip: tests/environments.py)
        params = [pytest.param(None, marks=pytest.mark.skip(reason=f"by design: {suite.plugin}: the suite has no "
                                                                   "factories or round trips (model-free checks only)"),
                               id="none")]
    metafunc.parametrize("conformance_round_trip", params)


@pytest.mark.conformance
class PluginConformance:
    """Base class of a plugin's conformance tests (not collected itself: its name lacks ``Test``)."""

    suite: Any = None
    timeout_s: float = 300.0

    def test_model_free_checks(self) -> None:
        """Registration, hook selection, metadata-only layouts and refusals."""
        from refit_core.testing.results import require
        from refit_core.testing.static import model_free_checks

        require(model_free_checks(self.suite))

    def test_round_trip(self, conformance_round_trip: Any) -> None:
        """Live pieces, precedence, begin / abort / finish, and a bitwise two-step refit in processes."""
        from refit_core.testing.live import round_trip
        from refit_core.testing.results import require

        trip, side = conformance_round_trip
        require(round_trip(self.suite, trip, side, self.timeout_s))
