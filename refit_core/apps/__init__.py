"""Programs built on refit: ``refit demo`` programs, rank launching, reference weights, the RL loop's pieces, Ray.

A plugin registers what ``refit demo`` runs for its backend as :class:`DemoPrograms` through the kit's hook
``refit_register_demos``; each program takes a :class:`DemoContext` (its ``reference(step)`` is the model's
checkpoint filled with deterministic weights, its ``progress`` what ``refit demo`` prints) and returns a
:class:`DemoReport`. :func:`send_versions` and :func:`train_demo` run a train program's ranks;
:func:`spawn` and :func:`free_port` launch ranks of your own; :func:`load_config` reads a model's config (a
preset name, a ``config.json`` or a model directory). Reference weights: :func:`reference_tensor`,
:func:`reference_state_dict` (deterministic weights for a checkpoint's tensors), :func:`reference_region`
(the box of them a piece holds, to load into a trainer), :func:`quantized_reference` (with FP8 tensors
quantized as refit quantizes them); :func:`mismatches` checks destination views against them and
:func:`same_bytes` two tensors, bit for bit (same dtype, shape and bytes: -0.0 is not 0.0). RL: :class:`Rollout`
and :func:`completion_logprobs`; a fleet of engine replicas that join, die and restart while the trainers refit:
:class:`RefitFleet` (every train rank; each step returns a ``FleetStep``, or under strict membership raises
:class:`FleetStepError`, whose ``result`` is that ``FleetStep``) and :func:`join_fleet` (every rank of a replica). Ray:
:class:`RayRefit` (the driver) and :class:`RefitTrainActor` (a train actor to subclass), loaded with Ray on
first use only.

Kept apart from :mod:`refit_core.kit` (what hooks build on) so that the plugin author's toolbox stays small
and says what it is for. The submodules are internal paths: import from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refit_core import _compat
from refit_core.fleet.records import FleetStepError
from refit_core.fleet.replica import join_fleet
from refit_core.fleet.trainer import RefitFleet
from refit_core.kit.demo import DemoContext, DemoPrograms, DemoReport, send_versions, train_demo
from refit_core.kit.launch import free_port, spawn
from refit_core.kit.models import load_config, reference_state_dict, reference_tensor
from refit_core.kit.rl import Rollout, completion_logprobs
from refit_core.kit.verify import mismatches, quantized_reference, reference_region, same_bytes

if TYPE_CHECKING:
    from refit_core.kit.ray import RayRefit, RefitTrainActor

__all__ = [
    "DemoContext", "DemoPrograms", "DemoReport", "FleetStepError", "RayRefit", "RefitFleet",
    "RefitTrainActor", "Rollout", "completion_logprobs", "free_port", "join_fleet", "load_config", "mismatches",
    "quantized_reference", "reference_region", "reference_state_dict", "reference_tensor", "same_bytes",
    "send_versions", "spawn", "train_demo",
]

LAZY = {"RayRefit": "refit_core.kit.ray", "RefitTrainActor": "refit_core.kit.ray"}
"""Names whose module is heavy to import (Ray): loaded on first access."""

__getattr__ = _compat.moved_names(__name__, {}, lazy=LAZY)
