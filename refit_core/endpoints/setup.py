"""One endpoint's setup, start to end: its pieces, the metadata exchange, its part of the plan, the agreement
barrier and the transport, each phase timed; a failure anywhere reaches every rank (:mod:`.agreement`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.experts import ExpertNaming, group_meta
from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import Piece
from refit_core.contract.plugins import PluginManager
from refit_core.contract.side import Side
from refit_core.endpoints import agreement
from refit_core.endpoints.binding import device_of
from refit_core.net.keys import RankId
from refit_core.net.rendezvous import Rendezvous
from refit_core.net.transport import StoreWatch, Transport, open_transport, resolve_kind
from refit_core.plan import rankplan
from refit_core.plan.links import Link
from refit_core.plan.planning import PlanCache
from refit_core.plan.schedule import Schedule
from refit_core.run.broadcast_links import broadcast_view
from refit_core.run.timing import SetupClock
from refit_core.run.validate import check_view


@dataclass(frozen=True)
class SetupRequest:
    """Who sets up, and what it brings: this rank's wishes and plugins, and the calls of its side."""

    me: RankId
    world_size: int
    address: str
    """The rendezvous address (``host:port``)."""
    options: RefitOptions
    host_id: str | None
    plugins: PluginManager
    experts: ExpertNaming
    pieces: Callable[[], list[Piece]]
    """This rank's pieces now."""
    check_plan: Callable[[Schedule, dict[tuple[int, int], Link], list[Piece]], None]
    """Raises if this rank cannot run the plan (its schedule and its pairs' links) with its pieces (before the
    agreement barrier)."""
    plans: PlanCache | None = None
    """The planner's plans kept across setups (None: plan every setup)."""


@dataclass(frozen=True)
class SetupResult:
    """What a setup agreed: the settings, this rank's part of the plan and its pieces, the device they live
    on, both sides' sizes, and the network transport (None: every pair of the plan is colocated)."""

    settings: RefitOptions
    own: agreement.OwnPlan
    pieces: list[Piece]
    device: torch.device
    sizes: dict[Side, int]
    transport: Transport | None


def set_up(rdv: Rendezvous, request: SetupRequest, clock: SetupClock) -> SetupResult:
    """Run the setup protocol for one rank over ``rdv``, timing each phase on ``clock``. On any failure every
    other rank is told why before this raises (the store's host waits until they read it)."""
    me, sizes = request.me, {}
    try:
        with clock.phase("pieces"):
            pieces = request.pieces()
            for p in pieces:  # a gen rank's views may be placeholders until its first bind
                if p.view is not None:
                    check_view(p.spec, p.box, p.view, destination=False, placeholder=me.side is Side.GEN)
            device = device_of(pieces)
        with clock.phase("metadata"):
            exchange = agreement.exchange_metadata(rdv, me, request.world_size, request.options, device,
                                                   request.host_id, pieces)
            sizes, settings = exchange.sizes, exchange.settings
            metas = (agreement.gather_metadata(rdv, sizes, [p.meta for p in pieces]) if me == agreement.PLANNER
                     else None)
        with clock.phase("plan"):
            own = agreement.own_plan(rdv, me, settings, sizes, metas, request.plugins, request.experts,
                                     request.plans)
            experts, namer = request.experts, request.plugins.expert_name
            experts.seen.update(own.part.experts)
            if metas is None:  # a part read from the planner; the planner's own is made from these very pieces
                experts.learn([[p.meta for p in pieces]])
                counts = own.part.facts.counts[me.side]
                rankplan.check_against(own.part, [group_meta(p.meta, namer, counts) for p in pieces])
            request.check_plan(own.schedule, own.links, pieces)
        with clock.phase("agree"):
            agreement.agree(rdv, me, own.part.facts.fingerprint, sizes)
        with clock.phase("transport"):  # the planner's answer, the same on every rank (relay always opens it)
            transport = open_network(rdv, request, settings, sizes, device) if own.part.facts.network else None
            if transport is not None and settings.relay.broadcast and own.relay is not None:
                transport = broadcast_view(transport, own.schedule, own.relay, me.side, me.rank, sizes[Side.TRAIN])
        clock.metadata_bytes = rdv.downloaded
    except Exception as exc:
        agreement.abort_setup(rdv, me, request.world_size, sizes, exc, request.options.timeout_s)
        raise
    return SetupResult(settings, own, pieces, device, sizes, transport)


def open_network(rdv: Rendezvous, request: SetupRequest, settings: RefitOptions, sizes: dict[Side, int],
                 device: torch.device) -> Transport:
    """Open the network transport (every rank passed the agreement barrier: all are ready to); a failure on
    any rank stops them all. Train ranks come first in refit's own process group, then gen ranks."""
    me = request.me
    rank = me.rank if me.side is Side.TRAIN else sizes[Side.TRAIN] + me.rank
    kind = resolve_kind(settings.transport, device)
    try:
        return open_transport(kind, rdv.store, rank, sum(sizes.values()), device, settings.timeout_s,
                              settings.options_for(kind), watch=StoreWatch(rdv.store, sizes),
                              rendezvous=request.address)
    except RefitError:
        raise
    except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
        raise RefitError(f"the {settings.transport} transport did not open: {exc}") from exc


__all__ = ["SetupRequest", "SetupResult", "open_network", "set_up"]
