"""vLLM general plugin (entry point ``vllm.general_plugins: refit``): registers the ``refit`` backend.

vLLM runs general plugins in every process it starts (engine core, every worker), so
``WeightTransferConfig(backend="refit")`` resolves there; trainer processes get the same
registration when they import :mod:`refit_vllm.transfer`.
"""

from __future__ import annotations

BACKEND = "refit"


def register() -> None:
    """Register refit with vLLM's worker-side and trainer-side weight-transfer factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "refit_vllm.transfer", "RefitWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "refit_vllm.transfer",
                                                     "RefitTrainerWeightTransferEngine")
