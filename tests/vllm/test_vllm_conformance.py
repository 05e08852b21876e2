"""The vllm plugin passes refit's conformance kit, model-free part: 5 presets x 7 layouts from
metadata, planned against the kit's reference checkpoint, and its refusals. (Its live engines are
checked against HF transformers' generations in test_vllm_engine.py.)"""

from tests.environments import require

require("refit_vllm")

from refit_vllm.conformance import SUITE

from refit_core.testing.pytest_plugin import PluginConformance


class TestVllmConformance(PluginConformance):
    suite = SUITE
