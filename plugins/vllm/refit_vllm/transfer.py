"""The ``refit`` backend of vLLM's weight-transfer API, worker side and trainer side: the module vLLM loads.

Worker side (:mod:`refit_vllm.worker_transfer`): each vLLM worker owns one :class:`RefitWeightTransferEngine`
(``LLM(..., weight_transfer_config=WeightTransferConfig(backend="refit"))``), driven by vLLM's
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``.
Trainer side (:mod:`refit_vllm.trainer_transfer`): every train rank owns one
:class:`RefitTrainerWeightTransferEngine` (``WeightTransferTrainerFactory.trainer_init(RefitTrainerInitInfo(...),
client=..., source=...)``). Importing this module registers the backend with vLLM's factories, which name
both engines by this module's path.
"""

from __future__ import annotations

from . import vllm_plugin
from .trainer_transfer import RefitSource, RefitTrainerInitInfo, RefitTrainerWeightTransferEngine, SourceKind
from .worker_transfer import (
    RefitWeightTransferEngine,
    RefitWeightTransferInitInfo,
    RefitWeightTransferUpdateInfo,
    receive_step,
    refuse_step,
    step_subset,
)

vllm_plugin.register()

__all__ = [
    "RefitSource", "RefitTrainerInitInfo", "RefitTrainerWeightTransferEngine", "RefitWeightTransferEngine",
    "RefitWeightTransferInitInfo", "RefitWeightTransferUpdateInfo", "SourceKind", "receive_step", "refuse_step",
    "step_subset",
]
