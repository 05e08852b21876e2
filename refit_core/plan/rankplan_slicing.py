"""Slicing the whole plan into every rank's part, in one pass (the planner's side)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from refit_core.contract.backend import GEN, TRAIN
from refit_core.contract.pieces import PieceMeta
from refit_core.plan.items import Message, ReceiverQuantization
from refit_core.plan.links import Link
from refit_core.plan.rankplan_records import PlanFacts, RankPlan, Rounds
from refit_core.plan.rankplan_wire import part_fingerprint
from refit_core.plan.relay import RelayPlan
from refit_core.plan.schedule import Schedule


def _by_rank(rounds: Sequence[Sequence[Message]], source: bool) -> dict[int, Rounds]:
    """Every rank's own rounds (a rank's empty rounds skipped), in one pass over ``rounds``."""
    out: dict[int, Rounds] = {}
    for msgs in rounds:
        this: dict[int, list[Message]] = {}
        for m in msgs:
            this.setdefault(m.src if source else m.dst, []).append(m)
        for rank, mine in this.items():
            out.setdefault(rank, []).append(mine)
    return out


def _aligned_by_rank(rounds: Sequence[Sequence[Message]], source: bool) -> dict[int, Rounds]:
    """Every rank's own rounds, one entry per round of ``rounds`` (empty where it has no part)."""
    out: dict[int, Rounds] = {}
    for index, msgs in enumerate(rounds):
        for m in msgs:
            mine = out.setdefault(m.src if source else m.dst, [[] for _ in rounds])
            mine[index].append(m)
    return out


def rank_plans(facts: PlanFacts, schedule: Schedule, relay: RelayPlan | None, links: dict[tuple[int, int], Link],
               metas: dict[str, Sequence[Sequence[PieceMeta]]],
               experts: dict[tuple[str, int], str]) -> Iterator[RankPlan]:
    """Every rank's part of the whole ``schedule`` (and ``relay``), train ranks first: ``metas`` are
    each side's grouped pieces as the planner saw them, ``experts`` the per-expert names it learned.
    One pass over the plan in all, so that the planner's slicing is O(plan + world)."""
    sends = _by_rank(schedule.rounds, True)
    receives = _by_rank(schedule.rounds, False)
    relay_in: dict[int, Rounds] = {}
    relay_out: dict[int, Rounds] = {}
    if relay is not None:
        slice_rounds = _aligned_by_rank if relay.within_nodes else _by_rank
        relay_in = slice_rounds(relay.schedule.rounds, False)
        if not relay.broadcast:  # a broadcast's relay messages come from the trainers: no gen rank sends them
            relay_out = slice_rounds(relay.schedule.rounds, True)
        if relay.within_nodes:  # a rank that only sends or only receives still posts every round
            empty: Rounds = [[] for _ in relay.schedule.rounds]
            for rank in set(relay_in) | set(relay_out):
                relay_in.setdefault(rank, empty)
                relay_out.setdefault(rank, empty)
    quantizing: dict[int, list[ReceiverQuantization]] = {}
    for q in (*schedule.receiver_quantizations, *(relay.schedule.receiver_quantizations if relay else ())):
        quantizing.setdefault(q.dst, []).append(q)
    pair_links: dict[tuple[str, int], dict[tuple[int, int], Link]] = {}
    for pair, link in links.items():
        pair_links.setdefault((TRAIN, pair[0]), {})[pair] = link
        pair_links.setdefault((GEN, pair[1]), {})[pair] = link
    by_group: dict[str, dict[tuple[str, int], str]] = {}
    for key, name in experts.items():
        by_group.setdefault(key[0], {})[key] = name
    for side in (TRAIN, GEN):
        for rank, mine in enumerate(metas[side]):
            source = side == TRAIN
            rounds = (sends if source else receives).get(rank, [])
            incoming, outgoing = ([], []) if source else (relay_in.get(rank, []), relay_out.get(rank, []))
            rq = () if source else tuple(quantizing.get(rank, ()))
            used: set[int] = set()
            for part, sending in ((rounds, source), (incoming, False), (outgoing, True)):
                for msgs in part:
                    for m in msgs:
                        used.update(s.piece for s in (m.src_segments if sending else m.dst_segments))
            for q in rq:
                used.update((q.piece, q.scale_piece))
            pieces = {i: mine[i] for i in sorted(used) if i < len(mine)}
            names: dict[tuple[str, int], str] = {}
            if not source:  # gen ranks name grouped experts back for the loader path
                for group in {m.spec.name for m in mine}:
                    names.update(by_group.get(group, {}))
            yield RankPlan(side, rank, facts, rounds, pair_links.get((side, rank), {}), rq, incoming, outgoing,
                           pieces, names, part_fingerprint(rounds, incoming, outgoing))
