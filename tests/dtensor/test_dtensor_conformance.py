"""The dtensor plugin passes refit's conformance kit: every model and layout of its suite from
metadata, and a TP-2 MoE round trip per side against the kit's reference side (real DTensors over gloo)."""

from refit_dtensor.conformance import SUITE

from refit_core.testing.pytest_plugin import PluginConformance


class TestDTensorConformance(PluginConformance):
    suite = SUITE
