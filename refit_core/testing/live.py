"""The live checks: the backend's own models, built by its factories, in real multi-process refits.

One round trip spawns the backend's ranks for one side and the kit's reference ranks for the other
(train ranks first), each in a fresh process. On the backend's ranks the kit checks, before setup,
that the live pieces equal the metadata-only ones and that no other installed plugin claims the
model; every rank checks that the live plan's fingerprint equals ``refit plan``'s for the same
layouts with default options; then two steps are refitted and the gen side is compared bit for bit
with the reference state dict, through the plugin's ``verify`` (or its destination map) and, where the
gen factory has a ``load``, against a second model that the engine's own loader filled with the same
reference (:func:`loader_differences`: independent of the destination map). Between the steps a
backend's gen ranks go through begin / abort and begin / write / finish by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit_core.contract.errors import PluginError
from refit_core.contract.experts import ExpertNaming
from refit_core.contract.layout import ParallelLayout
from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import DestinationPiece, Piece
from refit_core.contract.plugins import PluginManager
from refit_core.endpoints.receiver import RefitReceiver
from refit_core.endpoints.sender import RefitSender
from refit_core.kit.launch import RankFailure, free_port, spawn
from refit_core.kit.verify import mismatches, reference_region, same_bytes
from refit_core.plan.offline import plan_from_metadata
from refit_core.testing.memory import overlapping_views, uncovered
from refit_core.testing.reference import (
    REFERENCE_BACKEND,
    ReferenceEngine,
    ReferenceTrainer,
    per_expert_specs,
    reference_weights,
)
from refit_core.testing.results import CheckResult, Outcome
from refit_core.testing.static import kit_manager
from refit_core.testing.suite import Conformance, GenFactory, ModelCase, RankContext, RoundTrip, Side

SEED = 11
STEPS = 2
SCRIBBLE = -7.0
"""What the kit writes into destination views before an abort (no reference weight is exactly this)."""

RankChecks = list[tuple[str, list[str]]]


@dataclass(frozen=True)
class _Job:
    suite: Conformance
    model: ModelCase
    tested: Side
    train_layout: ParallelLayout
    gen_layout: ParallelLayout
    rendezvous: str
    init_methods: tuple[str, str]
    timeout_s: float

    @property
    def train_backend(self) -> str:
        return self.suite.backend if self.tested is Side.TRAIN else REFERENCE_BACKEND

    @property
    def gen_backend(self) -> str:
        return self.suite.backend if self.tested is Side.GEN else REFERENCE_BACKEND


def _metas(pieces: Sequence[Piece]) -> list[tuple[str, tuple[int, ...], str, Any]]:
    return [(p.spec.name, p.spec.shape, str(p.spec.dtype), p.box) for p in pieces]


def _first_difference(live: list, meta: list) -> str:
    for i, (a, b) in enumerate(zip(live, meta)):
        if a != b:
            return f"piece {i}: live {a[0]} {a[1]} {a[2]} {a[3]} vs metadata {b[0]} {b[1]} {b[2]} {b[3]}"
    return f"live has {len(live)} pieces, metadata {len(meta)}"


def _live_pieces(pm: PluginManager, side: Side, model: Any) -> list[Piece]:
    if side is Side.TRAIN:
        return list(pm.source_pieces(model))
    mapping = pm.destination_map(model)
    return [*mapping.pieces, *(DestinationPiece(s, s.full_box()) for s in mapping.loader)]


def check_live_equals_metadata(pm: PluginManager, job: _Job, rank: int, model: Any) -> list[str]:
    """Live pieces == ``refit_*_layout`` pieces for the same config, layout and rank: names, shapes,
    dtypes, boxes and order."""
    config = dict(job.model.config)
    meta: list[Piece]
    if job.tested is Side.TRAIN:
        meta = list(pm.source_layout(job.suite.backend, config, job.train_layout, rank))
    else:
        mapping = pm.destination_layout(job.suite.backend, config, job.gen_layout, rank)
        meta = [*mapping.pieces, *(DestinationPiece(s, s.full_box()) for s in mapping.loader)]
    live, expected = _metas(_live_pieces(pm, job.tested, model)), _metas(meta)
    return [] if live == expected else [_first_difference(live, expected)]


def check_only_owner_claims(pm: PluginManager, job: _Job, model: Any) -> list[str]:
    """Every other installed plugin answers None for this model, so the owner's answer is the one used
    whatever the registration order."""
    hook = "refit_source_pieces" if job.tested is Side.TRAIN else "refit_destination_map"
    claims = [impl.plugin_name for impl in getattr(pm.hook, hook).get_hookimpls()
              if impl.plugin_name != job.suite.plugin and impl.function(model=model) is not None]
    owner = [impl for impl in getattr(pm.hook, hook).get_hookimpls() if impl.plugin_name == job.suite.plugin]
    problems = [f"plugin {name!r} also claims this model in {hook}" for name in claims]
    if not owner or owner[0].function(model=model) is None:
        problems.append(f"{job.suite.plugin!r} does not claim its own model in {hook}")
    return problems


def _view(piece: Piece) -> torch.Tensor:
    if piece.view is None:
        raise PluginError(f"{piece.spec.name}{piece.box}: a live destination piece without a view")
    return piece.view


def _write_reference(pieces: list[DestinationPiece], state: dict[str, torch.Tensor], naming: ExpertNaming) -> None:
    for piece in pieces:
        _view(piece).copy_(reference_region(piece, state, naming))


def _loader_weights(pm: PluginManager, loader: list, state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The loader tensors of ``state`` under their checkpoint names, as refit hands them over."""
    names = {s.name for s in loader}
    return [(name, tensor) for name, tensor in state.items()
            if name in names or ((e := pm.expert_name(name)) is not None and e.group in names)]


def gen_semantics(pm: PluginManager, factory: GenFactory, model: Any, setup_metas: list,
                  verify: Callable[[dict[str, torch.Tensor]], list[str]], state: dict[str, torch.Tensor]) -> RankChecks:
    """begin / abort, then begin / write / finish, by hand, on a model that holds ``state``."""
    checks: RankChecks = []
    began = pm.hook.refit_begin_update(model=model)
    problems = [] if isinstance(began, bool) else [
        f"refit_begin_update returned {began!r} for its own model, not True or False"]
    mapping = pm.destination_map(model)
    pieces = list(mapping.pieces)
    metas = _metas([*pieces, *(DestinationPiece(s, s.full_box()) for s in mapping.loader)])
    if metas != setup_metas:
        problems.append("after refit_begin_update the destination map differs from setup's: "
                        + _first_difference(metas, setup_metas))
    checks.append(("begin_update answers and keeps the same pieces", problems))
    names = [f"{p.spec.name}{p.box}" for p in pieces]
    views = [_view(p) for p in pieces]
    checks.append(("destination views never share memory", overlapping_views(names, views)))
    if factory.parameters is not None:
        checks.append(("destination views cover every parameter", uncovered(factory.parameters(model), views)))
    for view in views:
        view.fill_(SCRIBBLE)
    torn = sorted({p.spec.name for p in pieces})  # every destination was scribbled on: all torn
    aborted = pm.hook.refit_abort_update(model=model, torn=torn)
    if factory.restores_on_abort:
        problems = [] if aborted is True else [f"refit_abort_update returned {aborted!r}, not True"]
        problems += [f"after abort, differs from the previous weights: {d}" for d in verify(state)]
        checks.append(("abort_update restores the previous weights", problems))
    else:
        checks.append(("abort_update answers without failing",
                       [] if aborted in (True, None) else [f"refit_abort_update returned {aborted!r}"]))
    pm.hook.refit_begin_update(model=model)
    mapping = pm.destination_map(model)
    _write_reference(list(mapping.pieces), state, pm.expert_naming())
    problems = []
    loaded = pm.hook.refit_load_weights(model=model, weights=_loader_weights(pm, mapping.loader, state)) \
        if mapping.loader else True
    if loaded is not True:
        problems.append("refit_load_weights did not return True for its own model")
    finished = pm.hook.refit_finish_update(model=model, version=1000)
    if finished is not True:
        problems.append(f"refit_finish_update returned {finished!r} for its own model, not True")
    problems += [f"after begin / write / finish, differs: {d}" for d in verify(state)]
    checks.append(("begin / write / finish lands the written weights", problems))
    return checks


def loader_differences(pm: PluginManager, factory: GenFactory, model: Any, twin: Any,
                       state: dict[str, torch.Tensor]) -> list[str]:
    """What differs, bit for bit, between the refitted ``model`` and ``twin`` after ``factory.load``
    put ``state`` into ``twin`` through the engine's own loader: ``factory.parameters`` by name if
    given, else the destination views position by position (the twin's bytes are the loader's, so a
    view that holds another slice than its box says differs)."""
    if factory.load is None:
        return []
    factory.load(twin, state)
    said = "differs from the engine's own loader of the reference"
    if factory.parameters is not None:
        ours, theirs = factory.parameters(model), factory.parameters(twin)
        return [f"{name}: {said}" if name in theirs else f"{name}: not in the reference model's parameters"
                for name, tensor in ours.items() if name not in theirs or not same_bytes(tensor, theirs[name])]
    pieces, references = pm.destination_map(model).pieces, pm.destination_map(twin).pieces
    if len(pieces) != len(references):
        return [f"the reference model has {len(references)} destination pieces, the refitted one {len(pieces)}"]
    return [f"{p.spec.name}{p.box}: {said}" for p, r in zip(pieces, references)
            if not same_bytes(_view(p), _view(r))]


def _setup(pm: PluginManager, job: _Job, endpoint: RefitSender | RefitReceiver) -> RankChecks:
    """Set up; the live plan's fingerprint must be ``refit plan``'s for the same layouts and options."""
    schedule = endpoint.setup()
    planned = plan_from_metadata(pm, dict(job.model.config), job.train_backend, job.train_layout,
                                 job.gen_backend, job.gen_layout).schedule
    problems = [] if planned.fingerprint == schedule.fingerprint else [
        (f"live fingerprint {schedule.fingerprint} (bucket {schedule.bucket_bytes}), "
         f"refit plan's {planned.fingerprint} (bucket {planned.bucket_bytes})")]
    return [("live plan equals `refit plan` with default options", problems)]


def _owner_checks(pm: PluginManager, job: _Job, rank: int, model: Any) -> RankChecks:
    return [("live pieces equal metadata-only pieces", check_live_equals_metadata(pm, job, rank, model)),
            ("only the owner claims its model", check_only_owner_claims(pm, job, model))]


def _train_rank(pm: PluginManager, job: _Job, ctx: RankContext, specs: list, naming: ExpertNaming) -> RankChecks:
    factory = job.suite.train if job.tested is Side.TRAIN else None
    model = factory.build(ctx) if factory is not None else ReferenceTrainer(specs, ctx.rank, ctx.world_size)
    checks = _owner_checks(pm, job, ctx.rank, model) if factory is not None else []
    sender = RefitSender(model, rendezvous=job.rendezvous, rank=ctx.rank, world_size=ctx.world_size,
                         options=RefitOptions(timeout_s=job.timeout_s), plugins=pm)
    checks += _setup(pm, job, sender)
    for step in range(STEPS):
        state = reference_weights(specs, SEED, step, naming)
        if factory is not None:
            factory.load(model, state)
        else:
            model.load(state)
        sender.send(version=step)
    sender.close()
    if factory is not None and factory.close is not None:
        factory.close(model)
    return checks


def _gen_rank(pm: PluginManager, job: _Job, ctx: RankContext, specs: list, naming: ExpertNaming) -> RankChecks:
    factory = job.suite.gen if job.tested is Side.GEN else None
    model = factory.build(ctx) if factory is not None else ReferenceEngine(specs, ctx.rank, ctx.world_size)
    checks = _owner_checks(pm, job, ctx.rank, model) if factory is not None else []
    setup_metas = _metas(_live_pieces(pm, Side.GEN, model))
    receiver = RefitReceiver(model, rendezvous=job.rendezvous, rank=ctx.rank, world_size=ctx.world_size,
                             options=RefitOptions(timeout_s=job.timeout_s), plugins=pm)
    checks += _setup(pm, job, receiver)

    twin: list[Any] = []  # the model the engine's own loader fills with the reference (built once)

    def verify(state: dict[str, torch.Tensor]) -> list[str]:
        if factory is None:
            return model.differences(state)
        if factory.verify is not None:
            problems = factory.verify(model, state)
        else:
            problems = mismatches(pm.destination_map(model).pieces, state, naming)
        if factory.load is not None:
            if not twin:
                twin.append(factory.build(ctx))
            problems += loader_differences(pm, factory, model, twin[0], state)
        return problems

    for step in range(STEPS):
        state = reference_weights(specs, SEED, step, naming)
        stats = receiver.receive()
        problems = [] if stats.version == step else [f"received version {stats.version}, sent {step}"]
        checks.append((f"step {step}: every destination byte equals the reference", problems + verify(state)))
        if step == 0 and factory is not None:
            checks += gen_semantics(pm, factory, model, setup_metas, verify, state)
    receiver.close()
    if factory is not None and factory.close is not None:
        for built in (model, *twin):
            factory.close(built)
    return checks


def round_trip_rank(rank: int, world: int, job: _Job) -> RankChecks:
    """One rank of a round trip (spawned; train ranks first): build, check, set up, refit twice, verify."""
    torch.set_num_threads(1)
    train_world = job.train_layout.world_size
    train = rank < train_world
    side = Side.TRAIN if train else Side.GEN
    side_rank, side_world = (rank, train_world) if train else (rank - train_world, world - train_world)
    layout = job.train_layout if train else job.gen_layout
    pm = kit_manager(job.suite, job.model)
    naming = pm.expert_naming()
    specs = per_expert_specs(job.model.specs(), naming)
    ctx = RankContext(side_rank, side_world, layout, job.model.config, job.init_methods[0 if train else 1])
    checks = (_train_rank if train else _gen_rank)(pm, job, ctx, specs, naming)
    return [(name, [f"{side.value} rank {side_rank}: {p}" for p in problems]) for name, problems in checks]


def round_trip(suite: Conformance, trip: RoundTrip, tested: Side, timeout_s: float = 300.0) -> list[CheckResult]:
    """Run one round trip of the backend's ``tested`` side against the reference side; one result per check."""
    layout, partner = ParallelLayout.parse(trip.layout), ParallelLayout.parse(trip.partner_layout)
    train_layout, gen_layout = (layout, partner) if tested is Side.TRAIN else (partner, layout)
    job = _Job(suite, trip.model, tested, train_layout, gen_layout, f"127.0.0.1:{free_port()}",
               (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"), timeout_s / 2)
    title = (f"{tested.value} round trip {trip.model.name} "
             f"{suite.backend}:{layout} {'->' if tested is Side.TRAIN else '<-'} {REFERENCE_BACKEND}:{partner}")
    try:
        per_rank = spawn(round_trip_rank, train_layout.world_size + gen_layout.world_size, job, timeout_s=timeout_s)
    except RankFailure as exc:
        return [CheckResult(title, Outcome.FAILED, (str(exc),))]
    merged: dict[str, list[str]] = {}
    for checks in per_rank:
        for name, problems in checks:
            merged.setdefault(name, []).extend(problems)
    return [CheckResult(f"{title}: {name}", Outcome.FAILED if problems else Outcome.PASSED, tuple(problems))
            for name, problems in merged.items()]


def round_trips(suite: Conformance, timeout_s: float = 300.0) -> list[CheckResult]:
    """Every round trip of the suite, for each side the backend serves with a factory."""
    results = []
    for trip in suite.round_trips:
        for side in Side:
            if suite.factory(side) is not None:
                results += round_trip(suite, trip, side, timeout_s)
    return results

