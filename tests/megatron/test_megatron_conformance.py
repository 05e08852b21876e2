"""The megatron plugin passes refit's conformance kit: 6 models (dense, tied, padded vocabulary, two
MoE families, MLA) x 12 layouts from metadata, its refusals, and a TP-2 MoE round trip of real
megatron-core ranks (gloo) into the kit's reference engine, two steps bit for bit."""

from tests.environments import require

require("refit_megatron")

from refit_megatron.conformance import SUITE

from refit_core.testing.pytest_plugin import PluginConformance


class TestMegatronConformance(PluginConformance):
    suite = SUITE

    def test_round_trip(self, conformance_round_trip):
        require("megatron.core")
        super().test_round_trip(conformance_round_trip)
