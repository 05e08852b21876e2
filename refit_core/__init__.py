"""refit: move freshly trained weights into a running inference engine, every RL step.

The public surface for users and plugins: :class:`RefitSender` (every train rank) and :class:`RefitReceiver`
(every gen rank), their settings (:class:`RefitOptions` with :class:`MessageOptions`, :class:`NcclOptions` and
:class:`RelayOptions`, and the enums of their modes), the data model plugins speak (:class:`TensorSpec`,
:class:`Box`, :class:`SourcePiece`, :class:`DestinationPiece`, :class:`DestinationMap`, :class:`ExpertName`,
:class:`Quantization` and its FP8 constants, :class:`LoraSpec` and :class:`LoraMode` (with
:class:`AdapterTensorName` and :func:`adapter_tensor_names`, the adapter tensors' names, and merged-mode
sources: :class:`MergedSourcePiece`, :class:`LoraMerge`, :class:`LoraFactors`, :class:`AdapterFactors`),
:class:`ParallelLayout`, :class:`Side`), :class:`Backend`,
``hookimpl`` and :class:`PluginManager` (refit's hook caller) for plugin authors, and the errors refit raises.
Plugin authors' helpers are :mod:`refit_core.kit`; the conformance kit is :mod:`refit_core.testing`. Every
other module is an internal path that may change between releases.
"""

from refit_core import _compat
from refit_core.contract.backend import GEN, TRAIN, Backend
from refit_core.contract.errors import (
    AuthenticationError,
    OptionError,
    PlanError,
    PluginError,
    RefitError,
    RendezvousError,
    TransferError,
)
from refit_core.contract.experts import ExpertName
from refit_core.contract.failures import StepFailedError, StepFailure, UpdateMode
from refit_core.contract.hookspecs import hookimpl
from refit_core.contract.layout import ParallelLayout
from refit_core.contract.lora import (
    AdapterFactors,
    AdapterTensorName,
    LoraFactors,
    LoraMerge,
    LoraMode,
    LoraSpec,
    MergedSourcePiece,
    adapter_tensor_names,
)
from refit_core.contract.options import (
    CastPolicy,
    MessageMode,
    MessageOptions,
    NcclBackend,
    NcclOptions,
    RefitOptions,
    RelayOptions,
    TransportKind,
)
from refit_core.contract.pieces import DestinationMap, DestinationPiece, SourcePiece
from refit_core.contract.plugins import PluginManager, get_plugin_manager
from refit_core.contract.side import Side
from refit_core.contract.spec import BLOCK_SCALE_SUFFIX, FP8_DTYPES, Box, Quantization, QuantScheme, TensorSpec
from refit_core.endpoints.receiver import RefitReceiver, StepStats
from refit_core.endpoints.sender import RefitSender

__all__ = [
    "AdapterFactors", "AdapterTensorName", "AuthenticationError", "BLOCK_SCALE_SUFFIX", "Backend", "Box",
    "CastPolicy", "DestinationMap", "DestinationPiece", "ExpertName", "FP8_DTYPES", "GEN", "LoraFactors", "LoraMerge",
    "LoraMode", "LoraSpec", "MergedSourcePiece", "MessageMode", "MessageOptions", "NcclBackend", "NcclOptions",
    "OptionError", "ParallelLayout", "PlanError", "PluginError", "PluginManager", "QuantScheme", "Quantization",
    "RefitError", "RefitOptions", "RefitReceiver", "RefitSender", "RelayOptions", "RendezvousError", "Side",
    "SourcePiece", "StepFailedError", "StepFailure", "StepStats", "TRAIN", "TensorSpec", "TransferError",
    "TransportKind", "UpdateMode", "adapter_tensor_names", "get_plugin_manager", "hookimpl",
]

_compat.install()
