"""The model-free checks: registration, hook selection, metadata-only layouts and refusals.

Nothing here builds a model: ``refit check-plugin NAME`` runs exactly these.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

import torch

from refit_core.contract.backend import GEN, TRAIN
from refit_core.contract.errors import PluginError
from refit_core.contract.experts import group_side
from refit_core.contract.layout import ParallelLayout
from refit_core.contract.lora import LoraSpec
from refit_core.contract.pieces import DestinationPiece, Piece, PieceMeta
from refit_core.contract.plugins import PluginManager
from refit_core.plan.offline import plan_from_metadata
from refit_core.testing.reference import (
    REFERENCE_BACKEND,
    REFERENCE_PLUGIN,
    ReferenceEngine,
    ReferencePlugin,
    ReferenceTrainer,
    per_expert_specs,
)
from refit_core.testing.results import CheckResult, Outcome, run_check
from refit_core.testing.suite import Conformance, ModelCase, Side

FOREIGN_BACKEND = "refit-conformance-nobody"
_MODEL_HOOKS = ("refit_source_pieces", "refit_destination_map", "refit_begin_update", "refit_finish_update",
                "refit_abort_update", "refit_load_weights")


def kit_manager(suite: Conformance, model: ModelCase) -> PluginManager:
    """The installed plugins (plus ``suite.module``) and the kit's reference side for ``model``'s checkpoint."""
    pm = PluginManager()
    if suite.module is not None and suite.plugin not in {p.name for p in pm.plugins}:
        module, _, attribute = suite.module.partition(":")
        plugin = importlib.import_module(module)
        pm.register(getattr(plugin, attribute) if attribute else plugin, name=suite.plugin)
    pm.register(ReferencePlugin(per_expert_specs(model.specs(), pm.expert_naming())), name=REFERENCE_PLUGIN)
    return pm


def foreign_models() -> list[Any]:
    """Models no backend plugin may claim: plain objects and the reference side's own models."""
    return [object(), {}, torch.nn.Linear(2, 2), ReferenceTrainer([], 0, 1), ReferenceEngine([], 0, 1)]


def _impls(pm: PluginManager, plugin: str, hook: str) -> list[Any]:
    return [impl for impl in getattr(pm.hook, hook).get_hookimpls() if impl.plugin_name == plugin]


def _call(impl: Any, **kwargs: Any) -> Any:
    return impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})


def check_registration(pm: PluginManager, suite: Conformance) -> list[str]:
    """The plugin is installed under its name, registers its backend, with the sides the suite tests."""
    info = next((p for p in pm.plugins if p.name == suite.plugin), None)
    if info is None:
        broken = pm.broken.get(suite.plugin)
        return [f"plugin {suite.plugin!r} is not registered" + (f" (import failed: {broken})" if broken else "")]
    backend = next((b for b in info.backends if b.name == suite.backend), None)
    if backend is None:
        return [(f"plugin {suite.plugin!r} registers no backend {suite.backend!r} "
                 f"(it registers {[b.name for b in info.backends]})")]
    problems = []
    for side, name in ((Side.TRAIN, TRAIN), (Side.GEN, GEN)):
        tested = bool(suite.layouts(side)) or suite.factory(side) is not None
        if tested and name not in backend.sides:
            problems.append(f"the suite tests the {name} side, but backend {suite.backend!r} serves "
                            f"{sorted(backend.sides)}")
        if name in backend.sides and not suite.layouts(side):
            problems.append(f"backend {suite.backend!r} serves the {name} side, but the suite lists no {name} layouts")
    return problems


def check_foreign(pm: PluginManager, suite: Conformance) -> list[str]:
    """Every hook of the plugin answers None for models and backend names that are not its own, so
    that the plugin that owns them answers (``firstresult``: the first non-None answer wins)."""
    problems = []
    for hook in _MODEL_HOOKS:
        for impl in _impls(pm, suite.plugin, hook):
            for model in foreign_models():
                try:
                    answer = _call(impl, model=model, weights=[], version=0, torn=[])
                except Exception as exc:  # noqa: BLE001 - reported as the problem it is
                    problems.append(f"{hook}({type(model).__name__}) raised {type(exc).__name__}: {exc}")
                    continue
                if answer is not None:
                    problems.append(f"{hook} claims a foreign {type(model).__module__}.{type(model).__qualname__} "
                                    f"(returned {type(answer).__name__}, must return None)")
    config = dict(suite.models[0].config) if suite.models else {}
    for hook in ("refit_source_layout", "refit_destination_layout", "refit_adapter_destination_layout"):
        for impl in _impls(pm, suite.plugin, hook):
            for backend in (FOREIGN_BACKEND, REFERENCE_BACKEND):
                answer = _call(impl, backend=backend, config=config, layout=ParallelLayout(), rank=0,
                               lora=LoraSpec(rank=8, alpha=16.0))
                if answer is not None:
                    problems.append(f"{hook} answers for backend {backend!r}, which is not its own")
    return problems


def _layout_metas(pm: PluginManager, suite: Conformance, side: Side, config: dict, layout: ParallelLayout,
                  rank: int) -> list[PieceMeta]:
    pieces: list[Piece]
    if side is Side.TRAIN:
        pieces = list(pm.source_layout(suite.backend, config, layout, rank))
        views = [p.view for p in pieces]
    else:
        mapping = pm.destination_layout(suite.backend, config, layout, rank)
        pieces = [*mapping.pieces, *(DestinationPiece(s, s.full_box()) for s in mapping.loader)]
        views = [p.view for p in mapping.pieces]
    if any(v is not None for v in views):
        raise PluginError(f"rank {rank}: metadata-only pieces must have view None")
    return [p.meta for p in pieces]


def layout_metas(pm: PluginManager, suite: Conformance, side: Side, model: ModelCase,
                 layout: ParallelLayout) -> list[list[PieceMeta]]:
    """Every rank's metadata-only pieces (for gen ranks: fast-path pieces, then loader tensors whole)."""
    return [_layout_metas(pm, suite, side, dict(model.config), layout, r) for r in range(layout.world_size)]


def check_layout(pm: PluginManager, suite: Conformance, side: Side, model: ModelCase,
                 layout: ParallelLayout) -> list[str]:
    """Metadata-only pieces of every rank: deterministic, views None, and planned against the kit's
    reference side exactly as ``refit plan`` would (names and shapes equal to the checkpoint, every
    element of every checkpoint tensor held by some train rank, no destination box written twice on a
    rank); on the gen side every checkpoint element is received by some rank."""
    config = dict(model.config)
    first = layout_metas(pm, suite, side, model, layout)
    if first != layout_metas(pm, suite, side, model, layout):
        return ["asked twice for the same rank, the layout hook answered differently"]
    problems = []
    single = ParallelLayout()
    try:
        if side is Side.TRAIN:
            plan_from_metadata(pm, config, suite.backend, layout, REFERENCE_BACKEND, single)
        else:
            plan_from_metadata(pm, config, REFERENCE_BACKEND, single, suite.backend, layout)
    except Exception as exc:  # noqa: BLE001 - the planner's error names the tensors
        problems.append(f"planning against the reference checkpoint failed: {type(exc).__name__}: {exc}")
    if side is Side.GEN:
        problems += uncovered_elements(first, pm, model)
    return problems


def uncovered_elements(ranks: Sequence[Sequence[PieceMeta]], pm: PluginManager, model: ModelCase) -> list[str]:
    """Checkpoint tensors (grouped) with elements that no rank's box covers."""
    grouped = group_side(ranks, pm.expert_name).metas
    reference = group_side([[PieceMeta(s, s.full_box()) for s in model.specs()]], pm.expert_name).metas
    masks = {m.spec.name: torch.zeros(m.spec.shape, dtype=torch.bool) for m in reference[0]}
    for metas in grouped:
        for meta in metas:
            if meta.spec.name in masks:
                meta.box.slice_of(masks[meta.spec.name]).fill_(True)
    return [f"{name}: {int((~mask).sum())} of {mask.numel()} elements are received by no gen rank"
            for name, mask in masks.items() if not mask.all()]


def check_refusal(pm: PluginManager, suite: Conformance, refusal: Any) -> list[str]:
    """The layout hook raises ``PluginError`` whose message contains ``refusal.match``."""
    model = refusal.model or suite.models[0]
    layout = ParallelLayout.parse(refusal.layout)
    try:
        for rank in range(layout.world_size):
            _layout_metas(pm, suite, refusal.side, dict(model.config), layout, rank)
    except PluginError as exc:
        return [] if refusal.match in str(exc) else [f"PluginError does not mention {refusal.match!r}: {exc}"]
    except Exception as exc:  # noqa: BLE001 - the wrong kind of refusal is the problem
        return [f"raised {type(exc).__name__} instead of PluginError: {exc}"]
    return [(f"{refusal.side.value} layout {refusal.layout!r} of {model.name} was accepted; "
             "it must be refused with PluginError")]


def model_free_checks(suite: Conformance) -> list[CheckResult]:
    """Every check that needs no model: registration, hook selection, layouts, refusals."""
    results = []
    models = suite.models or ()
    pm = kit_manager(suite, models[0]) if models else PluginManager()
    results.append(run_check("registration", lambda: check_registration(pm, suite)))
    if results[-1].outcome is Outcome.FAILED:
        return results
    results.append(run_check("hooks answer None for foreign models and backends", lambda: check_foreign(pm, suite)))
    for model in models:
        pm = kit_manager(suite, model)
        for side in Side:
            for text in suite.layouts(side):
                layout = ParallelLayout.parse(text)
                results.append(run_check(f"{side.value} layout {model.name} {layout}",
                                         functools.partial(check_layout, pm, suite, side, model, layout)))
    for refusal in suite.refusals:
        pm = kit_manager(suite, refusal.model or models[0])
        results.append(run_check(f"refuses {refusal.side.value} layout {refusal.layout!r}",
                                 functools.partial(check_refusal, pm, suite, refusal)))
    if not suite.refusals:
        results.append(CheckResult("refusals", Outcome.SKIPPED, note="the suite lists no refusal"))
    return results
