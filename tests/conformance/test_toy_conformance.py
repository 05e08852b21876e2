"""The example plugin passes refit's conformance kit (the same kit every plugin author uses)."""

from refit_toy.conformance import SUITE

from refit_core.testing.pytest_plugin import PluginConformance


class TestToyConformance(PluginConformance):
    suite = SUITE
