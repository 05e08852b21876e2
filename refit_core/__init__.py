"""refit: move freshly trained weights into a running inference engine, every RL step.

What users and plugins speak to refit: :class:`RefitSender` (every train rank) and :class:`RefitReceiver`
(every gen rank) with their one settings object :class:`RefitOptions` (nested settings are given as dicts:
``RefitOptions(messages={"zero_copy": False})``, modes as strings: ``RefitOptions(mode="staged")``); the data
model plugins speak (:class:`TensorSpec`, :class:`Box`, :class:`SourcePiece`, :class:`DestinationPiece`,
:class:`DestinationMap`, :class:`ExpertName`, :class:`ParallelLayout`, :class:`Side`, :class:`Quantization`,
and for LoRA :class:`LoraSpec`, :class:`LoraMode`, :func:`adapter_tensor_names`, and merged-mode sources
:class:`MergedSourcePiece`, :class:`LoraMerge`, :class:`LoraFactors`); :class:`Backend`, ``hookimpl``,
:func:`get_plugin_manager` and :class:`PluginManager` (a hook caller of your own) for plugin authors; and the
errors refit raises.

The other public modules: :mod:`refit_core.kit` (helpers for engine and trainer plugins),
:mod:`refit_core.apps` (``refit demo`` programs, ranks, RL and Ray), :mod:`refit_core.testing` (the
conformance kits) and :mod:`refit_core.transports` (for transport authors). Every other module is an internal
path that may change between releases. Names that left this module's ``__all__`` still import until refit 0.3,
with a :class:`DeprecationWarning` naming their new place (:data:`MOVED`).
"""

from refit_core import _compat
from refit_core.contract.backend import Backend
from refit_core.contract.errors import OptionError, PlanError, PluginError, RefitError, TransferError
from refit_core.contract.experts import ExpertName
from refit_core.contract.failures import StepFailedError
from refit_core.contract.hookspecs import hookimpl
from refit_core.contract.layout import ParallelLayout
from refit_core.contract.lora import (
    LoraFactors,
    LoraMerge,
    LoraMode,
    LoraSpec,
    MergedSourcePiece,
    adapter_tensor_names,
)
from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import DestinationMap, DestinationPiece, SourcePiece
from refit_core.contract.plugins import PluginManager, get_plugin_manager
from refit_core.contract.side import Side
from refit_core.contract.spec import Box, Quantization, TensorSpec
from refit_core.endpoints.receiver import RefitReceiver
from refit_core.endpoints.sender import RefitSender

__all__ = [
    "Backend", "Box", "DestinationMap", "DestinationPiece", "ExpertName", "LoraFactors", "LoraMerge", "LoraMode",
    "LoraSpec", "MergedSourcePiece", "OptionError", "ParallelLayout", "PlanError", "PluginError", "PluginManager",
    "Quantization", "RefitError", "RefitOptions", "RefitReceiver", "RefitSender", "Side", "SourcePiece",
    "StepFailedError", "TensorSpec", "TransferError", "adapter_tensor_names", "get_plugin_manager", "hookimpl",
]

_SETTING = "pass its fields as a dict or its value as a string to RefitOptions"
MOVED: dict[str, tuple[str, str]] = {
    # name: (module holding it, where to take it from now)
    "TRAIN": ("refit_core.contract.backend", "use refit_core.Side.TRAIN"),
    "GEN": ("refit_core.contract.backend", "use refit_core.Side.GEN"),
    "MessageOptions": ("refit_core.contract.options", f"{_SETTING} (RefitOptions(messages={{...}}))"),
    "RelayOptions": ("refit_core.contract.options", f"{_SETTING} (RefitOptions(relay={{...}}))"),
    "NcclOptions": ("refit_core.contract.options", f"{_SETTING} (RefitOptions(nccl={{...}}))"),
    "CastPolicy": ("refit_core.contract.options", f"{_SETTING} (RefitOptions(cast='strict'))"),
    "MessageMode": ("refit_core.contract.options", f"{_SETTING} (RefitOptions(messages={{'mode': ...}}))"),
    "NcclBackend": ("refit_core.contract.options", f"{_SETTING} (RefitOptions(nccl={{'backend': ...}}))"),
    "TransportKind": ("refit_core.contract.options", f"{_SETTING} (RefitOptions(transport='nccl'))"),
    "UpdateMode": ("refit_core.contract.failures", f"{_SETTING} (RefitOptions(mode='staged'))"),
    "QuantScheme": ("refit_core.contract.spec", "build quantizations with Quantization.block_fp8 / per_channel / "
                                                "per_tensor and read Quantization.scheme"),
    "FP8_DTYPES": ("refit_core.contract.spec", "compare with torch.float8_e4m3fn / torch.float8_e5m2"),
    "BLOCK_SCALE_SUFFIX": ("refit_core.contract.spec", "name the scale tensor as your checkpoint does "
                                                       "('..._scale_inv')"),
    "StepStats": ("refit_core.endpoints.receiver", "it is what RefitReceiver.receive() returns"),
    "StepFailure": ("refit_core.contract.failures", "read StepFailedError.failure / RefitReceiver.last_failure"),
    "RendezvousError": ("refit_core.contract.errors", "catch refit_core.RefitError"),
    "AuthenticationError": ("refit_core.contract.errors", "catch refit_core.RefitError"),
    "AdapterTensorName": ("refit_core.contract.lora", "use refit_core.adapter_tensor_names"),
    "AdapterFactors": ("refit_core.contract.lora", "any object with gather() -> {module: LoraFactors}"),
}
"""Names that left ``__all__`` (refit 0.3's smaller surface): where each lives, and what to use instead."""

__getattr__ = _compat.moved_names(__name__, MOVED)
_compat.install()
