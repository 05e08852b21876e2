"""How every rank of a refit agrees on one plan at setup: metadata exchange, planning, link assignment, agreement.

The steps, in the order an endpoint's ``setup()`` runs them (:mod:`refit_core.endpoints.base`); every key
they write is :mod:`refit_core.net.keys`':

1. :func:`exchange_metadata`: every rank adopts the train side's rank 0's options, publishes its piece
   metadata (all but the planner, which keeps its own) and placement, and learns both sides' sizes;
2. the planner (train rank 0) reads every rank's metadata (:func:`gather_metadata`), plans the whole
   refit, gives every pair its link (:func:`assign_links`) and publishes every other rank its own part
   (:func:`plan_for_all`); every other rank reads its part (:func:`read_own_part`);
3. :func:`agree`: every rank publishes the fingerprint of the plan it holds and waits at one barrier.

A rank that fails any step tells every other rank why (:func:`abort_setup`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit_core.contract.errors import PlanError, RefitError
from refit_core.contract.experts import ExpertNaming, group_side
from refit_core.contract.options import Colocation, RefitOptions
from refit_core.contract.pieces import Piece, PieceMeta
from refit_core.contract.plugins import PluginManager
from refit_core.contract.side import Side
from refit_core.net.keys import AGREED, OPTIONS, RankId, RankRecord, rank_key, rank_keys, side_rank_keys, size_key
from refit_core.net.rendezvous import Rendezvous
from refit_core.plan import codec, rankplan
from refit_core.plan.gcpause import gc_paused
from refit_core.plan.links import Link, Placement, pair_links, placement_of
from refit_core.plan.planning import PlanCache, plan_with_relay
from refit_core.plan.relay import RelayPlan, check_relay_pairs
from refit_core.plan.schedule import Schedule
from refit_core.plan.subset import logical_name

PLANNER = RankId(Side.TRAIN, 0)
"""The rank that reads every rank's metadata and plans (the store's host)."""
MAX_WORLD_SIZE = 1 << 20
"""The largest world size a rendezvous may hold (anything larger is a corrupt or hostile value)."""


@dataclass(frozen=True)
class Exchange:
    """What the metadata exchange tells every rank: the agreed settings and both sides' world sizes."""

    settings: RefitOptions
    sizes: dict[Side, int]
    """Each side's world size, the train side first."""


@dataclass(frozen=True)
class WholePlan:
    """The planner's plan: its own part, the whole schedule, the relay plan (None without relay) and
    every pair's link."""

    mine: rankplan.RankPlan
    schedule: Schedule
    relay: RelayPlan | None
    links: dict[tuple[int, int], Link]


@dataclass(frozen=True)
class OwnPlan:
    """What a rank keeps of the plan: its part, the schedule it runs (the whole one on the planner), the relay
    plan (None without relay) and its pairs' links, every grouped expert tensor's expert count (both sides'),
    and the logical tensors the train side sends (the planner's; None elsewhere)."""

    part: rankplan.RankPlan
    schedule: Schedule
    relay: RelayPlan | None
    links: dict[tuple[int, int], Link]
    groups: dict[str, int]
    train_names: frozenset[str] | None


def exchange_metadata(rdv: Rendezvous, me: RankId, world_size: int, options: RefitOptions, device: torch.device,
                      host_id: str | None, pieces: list[Piece]) -> Exchange:
    """Publish this rank's piece metadata (the planner keeps its own) and placement; return the agreed settings
    and both sides' sizes.

    The train side's rank 0 publishes its resolved options; every rank adopts them or, where it set a
    setting explicitly to another value, fails with a :class:`~refit_core.contract.errors.PlanError`
    naming it.
    """
    if me.rank == 0:
        rdv.publish(size_key(me.side), world_size)
    if me == RankId(Side.TRAIN, 0):
        rdv.publish(OPTIONS, options.resolved(device.type).to_wire())
    (published,) = rdv.wait([OPTIONS], "the train side's options")
    settings = options.agree_with(RefitOptions.from_wire(published), me.name)
    if me != PLANNER:  # the planner reads its own metadata where it is (gather_metadata)
        rdv.publish(rank_key(RankRecord.META, me), codec.metas_to_wire([p.meta for p in pieces]))
    rdv.publish(rank_key(RankRecord.PLACEMENT, me), placement_of(device, host_id).encode())
    sizes = rdv.wait([size_key(side) for side in Side], "both sides' sizes")
    if not all(type(n) is int and 0 < n <= MAX_WORLD_SIZE for n in sizes):
        raise RefitError(f"the rendezvous holds invalid world sizes {sizes!r:.80}")
    return Exchange(settings, dict(zip(Side, sizes)))


def gather_metadata(rdv: Rendezvous, sizes: dict[Side, int], own: list[PieceMeta]) -> dict[Side, list[list[PieceMeta]]]:
    """Every rank's piece metadata, per side in rank order (the planner's read). ``own``, its own, never
    travels (JSON text of a 19,000-tensor trainer's metadata costs 0.4 s to write and read); it is checked as
    every rank's is."""
    metas: dict[Side, list[list[PieceMeta]]] = {}
    own = codec.metas_from_wire(codec.metas_to_wire(own), PLANNER.name)
    for side in Side:
        first = 1 if side is PLANNER.side else 0
        keys = side_rank_keys(RankRecord.META, side, sizes[side])[first:]
        read = [codec.metas_from_wire(m, RankId(side, r).name)
                for r, m in enumerate(rdv.wait(keys, f"{side.value} metadata") if keys else [], start=first)]
        metas[side] = [own, *read] if first else read
    return metas


def read_own_part(rdv: Rendezvous, me: RankId) -> rankplan.RankPlan:
    """This rank's part of the plan, once the planner has published it."""
    (record,) = rdv.wait([rank_key(RankRecord.PLAN, me)], f"{me.name}'s part of the plan from train rank 0")
    return rankplan.from_wire(record, me.side, me.rank)


def own_plan(rdv: Rendezvous, me: RankId, settings: RefitOptions, sizes: dict[Side, int],
             metas: dict[Side, list[list[PieceMeta]]] | None, plugins: PluginManager,
             experts: ExpertNaming, plans: PlanCache | None = None) -> OwnPlan:
    """Step 2 for any rank: the planner (given every rank's ``metas``) plans for all (:func:`plan_for_all`),
    every other rank reads its own part (:func:`read_own_part`)."""
    if metas is not None:
        whole = plan_for_all(rdv, me, settings, sizes, metas, plugins, experts, plans)
        part, schedule, relay, links = whole.mine, whole.schedule, whole.relay, whole.links
    else:
        part = read_own_part(rdv, me)
        schedule, relay, links = part.schedule(), part.relay_plan(), part.links
    groups = {group: n for side in Side for group, n in part.facts.counts[side].items()}
    names = None if metas is None else frozenset(logical_name(m.spec.name, plugins.expert_name, groups)
                                                 for ranks in metas[Side.TRAIN] for m in ranks)
    return OwnPlan(part, schedule, relay, links, groups, names)


def plan_for_all(rdv: Rendezvous, me: RankId, settings: RefitOptions, sizes: dict[Side, int],
                 metas: dict[Side, list[list[PieceMeta]]], plugins: PluginManager, experts: ExpertNaming,
                 plans: PlanCache | None = None) -> WholePlan:
    """The planner: plan once and publish every other rank's part.

    With relay fanout the trainers feed only the first wave's replicas; the relay plan (waves, parents,
    relay messages) is hashed into the fingerprint with the settings. ``experts`` learns every rank's
    expert names; ``plans`` keeps plans across setups (None: plan every time).
    """
    grouped = {side: group_side(metas[side], plugins.expert_name) for side in Side}
    for side in Side:
        experts.learn(metas[side])
    groups = set(grouped[Side.GEN].counts) | set(grouped[Side.TRAIN].counts)
    with gc_paused():
        plan = plan_with_relay if plans is None else plans.plan
        schedule, relay = plan(grouped[Side.TRAIN].metas, grouped[Side.GEN].metas, settings, expert_groups=groups)
    links = assign_links(rdv, schedule, sizes, settings.colocate, relay)
    facts = rankplan.PlanFacts(
        schedule.fingerprint, schedule.num_src, schedule.num_dst, schedule.bucket_bytes, schedule.summary,
        relay is not None or any(link is Link.NETWORK for link in links.values()),
        {side: grouped[side].counts for side in Side},
        None if relay is None else rankplan.RelayFacts(relay.replica_size, relay.tree, relay.schedule.fingerprint,
                                                       relay.schedule.summary, relay.node_ranks))
    record = rankplan.facts_to_wire(facts)
    mine = None
    for part in rankplan.rank_plans(facts, schedule, relay, links, {side: grouped[side].metas for side in Side},
                                    dict(experts.seen)):
        who = RankId(Side(part.side), part.rank)
        if who == me:
            mine = part
        else:
            rdv.publish(rank_key(RankRecord.PLAN, who), rankplan.to_wire(part, record))
    assert mine is not None
    return WholePlan(mine, schedule, relay, links)


def assign_links(rdv: Rendezvous, schedule: Schedule, sizes: dict[Side, int], colocate: Colocation,
                 relay: RelayPlan | None) -> dict[tuple[int, int], Link]:
    """Every pair's link (:mod:`~refit_core.plan.links`), on the planner; a pair no transport can
    connect (same GPU, colocation off) is refused before any collective."""
    places = {side: [Placement.decode(text) for text in
                     rdv.wait(side_rank_keys(RankRecord.PLACEMENT, side, n), f"{side.value} placements")]
              for side, n in sizes.items()}
    pairs = {(m.src, m.dst) for msgs in schedule.rounds for m in msgs}
    links = pair_links(pairs, places[Side.TRAIN], places[Side.GEN], colocate)
    if relay is not None and relay.broadcast:  # its transport checks that each group's GPUs differ
        local = sorted(pair for pair, link in links.items() if link is not Link.NETWORK)
        if local:
            raise PlanError(f"relay by broadcast: (train rank, gen rank) pair(s) {local} share a GPU, and a "
                            "broadcast reaches its members over the network transport; place the replicas on GPUs "
                            "of their own, or relay without broadcast")
    elif relay is not None:
        check_relay_pairs(relay, places[Side.GEN])
        relaying = {m.src for msgs in relay.schedule.rounds for m in msgs}
        colocated = sorted({dst for (_, dst), link in links.items() if link is not Link.NETWORK and dst in relaying})
        if colocated and not relay.within_nodes:
            raise PlanError(f"relay: gen rank(s) {colocated} relay to other replicas but get part of the step from a "
                            "trainer on the same GPU (CUDA IPC), which they cannot forward; place the replicas the "
                            "trainers feed on GPUs of their own, or run without relay")
    return links


def agree(rdv: Rendezvous, me: RankId, fingerprint: str, sizes: dict[Side, int]) -> None:
    """Publish the fingerprint of the plan this rank holds and wait until every rank of both sides has
    (a barrier before any collective)."""
    rdv.publish(rank_key(RankRecord.FINGERPRINT, me), fingerprint)
    rdv.barrier(AGREED, sum(sizes.values()), rank_keys(RankRecord.FINGERPRINT, sizes),
                f"every rank to agree on plan {fingerprint}")


def abort_setup(rdv: Rendezvous, me: RankId, world_size: int, sizes: dict[Side, int], exc: Exception,
                timeout_s: float) -> None:
    """Tell every rank why this rank's setup failed (``exc``); the store's host (train rank 0) waits until
    every rank has read it. ``sizes``: both sides' sizes, if this rank learned them (empty otherwise)."""
    if me.rank == 0 or not sizes:  # the host learns how many ranks must read the error
        rdv.offer(size_key(me.side), world_size)
    rdv.fail(exc, me.name, rank_key(RankRecord.DONE, me))
    if me != RankId(Side.TRAIN, 0):
        return
    if not sizes:  # failed before learning the gen side's size: wait for it to show up
        rdv.linger([size_key(Side.GEN)], timeout_s=timeout_s)
        sizes = {Side.TRAIN: world_size, Side.GEN: rdv.read(size_key(Side.GEN), default=0)}
    rdv.linger(rank_keys(RankRecord.DONE, sizes), timeout_s=timeout_s)
