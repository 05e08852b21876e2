"""refit: move freshly trained weights into a running inference engine, every RL step.

The public surface: :class:`RefitSender` (every train rank) and :class:`RefitReceiver` (every gen
rank), :class:`RefitOptions`, the data model plugins speak (:class:`TensorSpec`, :class:`Box`,
:class:`SourcePiece`, :class:`DestinationPiece`, :class:`DestinationMap`), :class:`Backend` and
``hookimpl`` for plugin authors.
"""

from .api import RefitOptions, RefitReceiver, RefitSender, StepStats
from .backend import GEN, TRAIN, Backend
from .errors import PlanError, PluginError, RefitError, TransferError
from .experts import ExpertName
from .layout import ParallelLayout
from .pieces import DestinationMap, DestinationPiece, SourcePiece
from .plugins import get_plugin_manager, hookimpl
from .spec import Box, TensorSpec

__all__ = [
    "GEN", "TRAIN", "Backend", "RefitOptions", "RefitReceiver", "RefitSender", "StepStats", "Box", "DestinationMap", "DestinationPiece", "ExpertName",
    "ParallelLayout", "PlanError", "PluginError", "RefitError", "SourcePiece", "TensorSpec",
    "TransferError", "get_plugin_manager", "hookimpl",
]

