"""refit: move freshly trained weights into a running inference engine, every RL step.

The public surface: :class:`RefitSender` (every train rank) and :class:`RefitReceiver` (every gen
rank), their settings (:class:`RefitOptions` with :class:`MessageOptions`, :class:`NcclOptions` and
:class:`RelayOptions`, and the enums of their modes), the data model plugins speak (:class:`TensorSpec`, :class:`Box`,
:class:`SourcePiece`, :class:`DestinationPiece`, :class:`DestinationMap`, :class:`ExpertName`),
:class:`Backend` and ``hookimpl`` for plugin authors, and the errors refit raises.
"""

from refit_core import _compat
from refit_core.receiver import RefitReceiver, StepStats
from refit_core.sender import RefitSender
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
from refit_core.contract.layout import ParallelLayout
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
from refit_core.contract.plugins import get_plugin_manager, hookimpl
from refit_core.contract.spec import Box, TensorSpec

__all__ = [
    "GEN", "TRAIN", "Backend", "Box", "CastPolicy", "DestinationMap", "DestinationPiece", "ExpertName",
    "MessageMode", "MessageOptions", "NcclBackend", "NcclOptions", "OptionError", "ParallelLayout", "PlanError",
    "PluginError", "RefitError", "RefitOptions", "RefitReceiver", "RelayOptions", "RefitSender", "SourcePiece",
    "StepStats", "TensorSpec", "TransferError", "TransportKind", "get_plugin_manager", "hookimpl",
    "AuthenticationError", "RendezvousError", "StepFailedError", "StepFailure", "UpdateMode",
]

_compat.install()
