"""The plugin contract: every hook a backend plugin may implement.

A plugin is a module (or object) with functions named like the hooks below, decorated with
``refit_core.hookimpl``, and registered under the entry-point group ``refit``. Hooks that take a
model *select themselves by that model*: a plugin returns None for a model it does not know, and the
first non-None answer wins (``firstresult``). Hooks that take a ``backend`` name (metadata only,
no model built) answer only for their own backend names.

Precedence. Plugins registered later are asked first: entry-point plugins are registered in the
order of their names (so ``zeta`` is asked before ``alpha``), plugins registered in code after them,
and the core's own defaults (``refit_expert_name``, ``refit_expert_member_name``) are asked last. A
plugin that must answer before the others marks its hook ``hookimpl(tryfirst=True)``.

Refusing. A hook that recognizes its model (or backend) but cannot express its layout as pieces
(an unsupported parallelism, a parameter it cannot view) raises
:class:`~refit_core.contract.errors.PluginError` naming the parameter and the reason; refit stops setup on
every rank with that message, before any collective. Returning None instead means "not mine".

Call order.

1. Once per process: ``refit_register_backends`` when the plugin is registered.
2. ``setup()``: ``refit_source_pieces`` on every train rank, ``refit_destination_map`` on every gen
   rank, then ``refit_expert_name`` for every piece name (on every rank, for both sides' names).
3. Every step: ``refit_model_tensors`` on both sides (else ``refit_source_pieces`` /
   ``refit_destination_map`` again); on gen ranks ``refit_begin_update``; ``refit_destination_map``
   again if it returned True; the bytes land; ``refit_load_weights`` when the map has loader tensors
   (``refit_expert_member_name`` names grouped experts back); ``refit_finish_update``. If anything fails after
   ``refit_begin_update``, ``refit_abort_update`` runs instead of ``refit_finish_update`` and the
   error is re-raised.
4. ``refit plan``: ``refit_source_layout`` / ``refit_destination_layout`` per rank (no model built); with
   ``--lora`` in adapter mode, ``refit_adapter_destination_layout`` per gen rank first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from refit_core.contract.backend import Backend
    from refit_core.contract.experts import ExpertName
    from refit_core.contract.layout import ParallelLayout
    from refit_core.contract.lora import LoraSpec
    from refit_core.contract.pieces import DestinationMap, SourcePiece

hookspec = pluggy.HookspecMarker("refit")
"""Marks a hook specification: the hooks below, and hooks the kit declares above the contract."""
hookimpl = pluggy.HookimplMarker("refit")
"""Marks a plugin's hook implementation (re-exported as ``refit_core.hookimpl``)."""


# -------------------------------------------------------------------------------------------------
# Setup: once per process when a plugin is registered, then at ``setup()`` on every rank
# -------------------------------------------------------------------------------------------------

@hookspec
def refit_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the backends this plugin provides by calling ``register(Backend(...))``.

    A backend has a name (``"dtensor"``, ``"vllm"``), the side(s) it serves (``Side.TRAIN``,
    ``Side.GEN``) and a description. The programs ``refit demo`` runs for it are registered through
    the kit's own hook, :meth:`refit_core.kit.demo.DemoHookspecs.refit_register_demos`.
    """


@hookspec(firstresult=True)
def refit_source_pieces(model: Any) -> list[SourcePiece] | None:
    """This training rank's source pieces for a live ``model``, or None if the model is not yours.

    Each piece names a logical HF tensor (per-expert or grouped names), the box of it this rank
    holds, and a view of local memory with exactly those elements (strided views are welcome;
    never gather or copy). Views must stay valid across steps: update parameters in place.
    Replicas (data-parallel copies) return identical pieces; the planner balances them.
    """


@hookspec(firstresult=True)
def refit_destination_map(model: Any) -> DestinationMap | None:
    """This generation rank's destination map for a live ``model``, or None if not yours.

    ``pieces`` are views of engine memory to write straight into (e.g. the rows of a fused
    ``qkv_proj`` that hold this TP rank's slice of ``k_proj``); ``loader`` lists the logical tensors
    that must instead be received whole and handed to ``refit_load_weights``.
    The hook is called at setup and again after every ``refit_begin_update`` that returns True,
    and must then return the same pieces (same specs and boxes, in the same order). For an engine
    whose ``refit_begin_update`` returns True, the setup-time views may be placeholders (right shape,
    dtype and device, not writable): refit writes only into views obtained after ``begin_update``.
    A piece holding FP8 values carries a :class:`~refit_core.contract.spec.Quantization` in its spec, and
    its scales are pieces of their own (see docs/writing-a-plugin.md, "Quantized destinations").
    """


@hookspec(firstresult=True)
def refit_expert_name(hf_name: str) -> ExpertName | None:
    """Split a per-expert HF name into its grouped logical name and expert index.

    The core's default handles ``...experts.{e}.{rest}``; implement this only for other naming
    schemes, and return None for names that are not per-expert tensors of yours (the default
    then tries). Implement :func:`refit_expert_member_name` with it.
    """


@hookspec(firstresult=True)
def refit_expert_member_name(group: str, index: int) -> str | None:
    """The checkpoint's per-expert name of expert ``index`` of the grouped tensor ``group``.

    The inverse of :func:`refit_expert_name` (which must map the answer back to ``(group, index)``,
    or refit raises :class:`~refit_core.contract.errors.PluginError`). Used where grouped tensors go back to
    the engine or a reference under checkpoint names: the loader path and verification. Per-expert
    names that either side's pieces carry are used first, so this hook matters only for groups no
    piece names per expert. Return None for groups that are not yours.
    """


# -------------------------------------------------------------------------------------------------
# Metadata only: ``refit plan`` and the conformance kit describe a backend's ranks without building a model
# -------------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def refit_source_layout(
    backend: str, config: dict[str, Any], layout: ParallelLayout, rank: int
) -> list[SourcePiece] | None:
    """Source pieces of ``rank`` from metadata alone (views are None), or None if not ``backend``.

    ``config`` is a HuggingFace ``config.json`` as a dict. Nothing is built and no tensor is
    allocated: this is what lets ``refit plan`` reason about thousands of ranks.
    """


@hookspec(firstresult=True)
def refit_destination_layout(
    backend: str, config: dict[str, Any], layout: ParallelLayout, rank: int
) -> DestinationMap | None:
    """The destination map of ``rank`` from metadata alone (views are None), or None."""


@hookspec(firstresult=True)
def refit_adapter_destination_layout(
    backend: str, config: dict[str, Any], layout: ParallelLayout, rank: int, lora: LoraSpec
) -> DestinationMap | None:
    """The adapter pieces ``rank`` receives in adapter mode (``lora``), from metadata alone: the boxes of
    ``lora_A`` / ``lora_B`` (:func:`refit_core.adapter_tensor_names`) the engine's LoRA slots hold.

    None if not ``backend``, or if its slots are sharded like its base weights: refit then derives the
    adapter from :func:`refit_destination_layout`'s pieces (:func:`refit_core.plan.lora.adapter_metas`).
    Raise :class:`~refit_core.contract.errors.PlanError` for an adapter the engine cannot hold.
    """


# -------------------------------------------------------------------------------------------------
# Per step: every gen step's update of a live model
# -------------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def refit_model_tensors(model: Any) -> list[tuple[str, torch.Tensor]] | None:
    """The named tensors whose memory ``model``'s pieces view (a trainer's parameters, an engine's
    weights), in a stable order and cheap to list: before every step refit checks that none was
    replaced or moved since it bound the pieces, and names the one that was.

    None if not yours: refit then asks ``refit_source_pieces`` / ``refit_destination_map`` again before
    every step to check the same, which costs what those hooks cost.
    """


@hookspec(firstresult=True)
def refit_begin_update(model: Any) -> bool | None:
    """Prepare ``model`` to receive new weights, before any byte lands.

    Return True if destination views changed (the engine re-materialized its parameters), so
    ``refit_destination_map`` is asked again; False if the views stay valid; None if not yours
    (refit then treats the views as valid).
    """


@hookspec(firstresult=True)
def refit_load_weights(model: Any, weights: list[tuple[str, torch.Tensor]]) -> bool | None:
    """Hand whole HF tensors (the loader path) to the engine's own loader; True when done.

    Called once per step, after the fast-path bytes landed, with every loader tensor of the step
    under its checkpoint name (grouped experts arrive split back into the checkpoint's per-expert
    names, through ``refit_expert_member_name`` or the names the pieces carried). None means not
    yours: with loader tensors and no plugin answering, refit raises ``PluginError``.
    """


@hookspec(firstresult=True)
def refit_finish_update(model: Any, version: int) -> bool | None:
    """Finish a refit: post-load processing, cache resets, publishing the weight ``version``.

    Return True when done, None if not yours (a model no plugin finishes needs no finishing).
    """


@hookspec(firstresult=True)
def refit_abort_update(model: Any, torn: list[str]) -> bool | None:
    """A step failed after ``refit_begin_update`` (a peer died or stalled, a header disagreed).

    ``torn`` names the logical tensors (HF names, experts grouped) whose engine memory the step may
    have written partly or wholly; empty means every destination still holds its previous weights
    (always so in staged mode). Put ``model`` back in a state that serves its previous weights
    (restore the torn tensors if you kept a copy), or make it refuse to serve until the next
    successful refit.

    Return True when handled (the previous weights serve again, or the model refuses to serve);
    False when the model is yours but you could not do either (refit adds a note to the re-raised
    error saying the engine may hold a mix of versions until the next successful ``receive()``);
    None if not yours.
    """
