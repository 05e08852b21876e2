"""The sglang backend's conformance suite (entry point ``refit.conformance: sglang``): model-free.

Every preset and layout below is described from metadata alone (:mod:`refit_sglang.layout`, no
SGLang import) and planned against the kit's reference checkpoint; layouts SGLang cannot take are
refused with ``PluginError``. SGLang's real model classes build only in their own virtualenv
(``scripts/setup-sglang-env.sh``); ``tests/sglang/test_sglang_refit.py`` refits into them there and
checks their live pieces against these layouts. ``refit check-plugin sglang`` runs this suite
without SGLang installed.
"""

from __future__ import annotations

from refit_core import Side
from refit_core.testing import Conformance, ModelCase, Refusal

MODELS = tuple(ModelCase.preset(name) for name in
               ("tiny-llama", "tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe", "tiny-mixtral"))
MOE = ModelCase.preset("tiny-qwen3-moe")

SUITE = Conformance(
    plugin="sglang",
    backend="sglang",
    models=MODELS,
    gen_layouts=("", "tp=2", "tp=4", "tp=2,ep=2", "tp=4,ep=2", "tp=4,ep=4", "tp=2,dp=2", "tp=2,ep=2,dp=2"),
    refusals=(Refusal(Side.GEN, "pp=2", "sglang layouts take tp, ep and dp"),
              Refusal(Side.GEN, "fsdp=2", "sglang layouts take tp, ep and dp"),
              Refusal(Side.GEN, "tp=2,ep=4", "must divide", MOE)),
)
