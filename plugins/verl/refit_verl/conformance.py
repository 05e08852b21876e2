"""The verl backend's conformance suite (entry point ``refit.conformance: verl``): model-free.

``refit check-plugin verl`` checks registration, hook selection, the FSDP2 / HSDP layouts verl's FSDP engine
builds and the refusal of the others, without verl installed. The live side, a real verl actor moving its
shards, is tests/verl (verl's own workers, in ``.venv-verl``).
"""

from __future__ import annotations

from refit_core import Side
from refit_core.testing import Conformance, ModelCase, Refusal

SUITE = Conformance(
    plugin="verl",
    backend="verl",
    models=tuple(ModelCase.preset(name) for name in ("tiny-llama", "tiny-qwen3-tied", "tiny-qwen3-moe")),
    train_layouts=("", "fsdp=2", "dp=2,fsdp=2"),
    refusals=(Refusal(Side.TRAIN, "tp=2", "fsdp and dp only"), Refusal(Side.TRAIN, "pp=2", "fsdp and dp only")),
)
