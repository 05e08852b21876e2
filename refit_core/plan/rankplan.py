"""Each rank's own part of the plan, as compact, schema-checked JSON (what the planner publishes).

Train rank 0 plans the whole refit once; every other rank reads only its :class:`RankPlan`: the
plan-wide facts (fingerprint, sizes, summary, expert counts, whether the network transport opens,
the relay tree) and its own messages, links, receiver-side quantizations and relay messages.
Messages travel as arrays, a segment as a run of integers in one flat list per message side
(``piece, offset, dtype, quant, scales_offset, ndim, *offsets, *sizes``; ``quant`` indexes the
record's table of quantizations, -1 for none), so a rank's record grows with its own messages only.

:func:`check_against` holds a rank's part against the pieces it declared itself before any
collective: every piece its own segments touch must be the tensor, dtype and shape it has, and every
segment must lie inside that piece. :func:`part_fingerprint` digests a rank's messages; the planner
publishes it and the rank recomputes it over what it decoded, so a rank runs exactly what was planned.

This module is the face of four rooms: :mod:`~refit_core.plan.rankplan_records` (the records),
:mod:`~refit_core.plan.rankplan_slicing` (the planner cuts the plan into parts),
:mod:`~refit_core.plan.rankplan_wire` (JSON both ways, the part digest) and
:mod:`~refit_core.plan.rankplan_checks` (the receiving rank's checks).
"""

from refit_core.plan.rankplan_checks import check_against
from refit_core.plan.rankplan_records import PlanFacts, RankPlan, RelayFacts, Rounds
from refit_core.plan.rankplan_slicing import rank_plans
from refit_core.plan.rankplan_wire import FORMAT, facts_from_wire, facts_to_wire, from_wire, part_fingerprint, to_wire

__all__ = ["FORMAT", "PlanFacts", "RankPlan", "RelayFacts", "Rounds", "check_against", "facts_from_wire",
           "facts_to_wire", "from_wire", "part_fingerprint", "rank_plans", "to_wire"]
