"""The sglang plugin passes refit's conformance kit, model-free part: 5 presets x 8 layouts from
metadata, planned against the kit's reference checkpoint, and its refusals. No SGLang import: this
runs in ``.venv`` as well as ``.venv-sglang`` (SGLang's live model classes are checked in
test_sglang_refit.py, which runs only where SGLang is installed)."""

from tests.environments import require

require("refit_sglang")

from refit_sglang.conformance import SUITE

from refit_core.testing.pytest_plugin import PluginConformance


class TestSglangConformance(PluginConformance):
    suite = SUITE
