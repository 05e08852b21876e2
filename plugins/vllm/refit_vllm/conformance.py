"""The vllm backend's conformance suite (entry point ``refit.conformance: vllm``): model-free.

Every preset and layout below is described from metadata alone and planned against the kit's
reference checkpoint; bad layouts must be refused with ``PluginError``. Live engines (which need
vLLM installed and several seconds each) are exercised by ``tests/vllm`` against HF transformers'
generations; ``refit check-plugin vllm`` runs this suite without vLLM installed.
"""

from __future__ import annotations

from refit_core import Side
from refit_core.testing import Conformance, ModelCase, Refusal

MODELS = tuple(ModelCase.preset(name) for name in
               ("tiny-llama", "tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe", "tiny-mixtral"))
MOE = ModelCase.preset("tiny-qwen3-moe")

SUITE = Conformance(
    plugin="vllm",
    backend="vllm",
    models=MODELS,
    gen_layouts=("", "tp=2", "tp=4", "pp=2", "tp=2,pp=2", "tp=2,dp=2", "tp=2,ep=2"),
    refusals=(Refusal(Side.GEN, "fsdp=2", "vllm layouts take tp, pp, dp and ep"),
              Refusal(Side.GEN, "tp=2,ep=4", "ep must be 2", MOE),
              Refusal(Side.GEN, "tp=3", "cannot split 4 attention heads over 3 ranks")),
)
