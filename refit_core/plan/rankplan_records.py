"""The records of one rank's part of the plan: the plan-wide facts and what the rank itself runs."""

from __future__ import annotations

from dataclasses import dataclass

from refit_core.contract.pieces import PieceMeta
from refit_core.plan.items import Message, ReceiverQuantization
from refit_core.plan.links import Link
from refit_core.plan.relay import RelayPlan, RelayTree
from refit_core.plan.schedule import Schedule, ScheduleSummary

Rounds = list[list[Message]]


@dataclass(frozen=True)
class PlanFacts:
    """What every rank learns of the whole plan (O(1) in the world size, save the relay's tree)."""

    fingerprint: str
    num_src: int
    num_dst: int
    bucket_bytes: int
    summary: ScheduleSummary
    network: bool
    """Whether the network transport opens (any pair uses it, or relay): the same on every rank."""
    counts: dict[str, dict[str, int]]
    """Experts per grouped tensor, per side (what grouping a rank's own pieces needs)."""
    relay: RelayFacts | None


@dataclass(frozen=True)
class RelayFacts:
    """The relay plan's plan-wide part: replica size, tree, its own fingerprint and summary."""

    replica_size: int
    tree: RelayTree
    fingerprint: str
    summary: ScheduleSummary
    node_ranks: int = 0
    """Gen ranks per node when the relay forwards within nodes (0: replica relay)."""


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of the plan: the plan-wide facts and what this rank itself runs."""

    side: str
    rank: int
    facts: PlanFacts
    rounds: Rounds
    links: dict[tuple[int, int], Link]
    receiver_quantizations: tuple[ReceiverQuantization, ...]
    relay_in: Rounds
    relay_out: Rounds
    pieces: dict[int, PieceMeta]
    """The planner's view of the local pieces this rank's segments touch (by grouped piece index)."""
    experts: dict[tuple[str, int], str]
    """Per-expert names of the groups this rank holds (gen ranks name experts back for the loader)."""
    part: str
    """:func:`part_fingerprint` of ``rounds``, ``relay_in`` and ``relay_out`` as the planner made them."""

    def schedule(self) -> Schedule:
        """This rank's :class:`Schedule`: the plan's fingerprint and summary, its own rounds only."""
        f = self.facts
        quant = self.receiver_quantizations
        return Schedule(f.num_src, f.num_dst, f.bucket_bytes, self.rounds, f.fingerprint, f.summary, quant)

    def relay_plan(self) -> RelayPlan | None:
        """The relay plan with this rank's relay messages, or None. Replica relay: incoming rounds, then
        outgoing. Forwarding within nodes: every round of the plan, each with this rank's messages of
        both directions (empty where it has none), so that all ranks post round ``i`` together."""
        r = self.facts.relay
        if r is None:
            return None
        world = self.facts.num_dst
        rounds = ([[*i, *o] for i, o in zip(self.relay_in, self.relay_out)] if r.node_ranks
                  else [*self.relay_in, *self.relay_out])
        schedule = Schedule(world, world, self.facts.bucket_bytes, rounds, r.fingerprint, r.summary)
        return RelayPlan(r.replica_size, r.tree, schedule, r.node_ranks)
