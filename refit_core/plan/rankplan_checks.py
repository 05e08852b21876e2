"""Holding a rank's part of the plan against the pieces it declared itself, before any collective."""

from __future__ import annotations

from collections.abc import Sequence

from refit_core.contract.backend import TRAIN
from refit_core.contract.errors import PlanError
from refit_core.contract.pieces import PieceMeta
from refit_core.plan.items import Segment
from refit_core.plan.rankplan_records import RankPlan
from refit_core.plan.rankplan_wire import part_fingerprint


def check_against(plan: RankPlan, local: Sequence[PieceMeta]) -> None:
    """Hold ``plan`` against this rank's own (grouped) pieces ``local``; a :class:`PlanError` naming
    the tensor if the planner saw another piece than this rank has, or a segment leaves its piece.
    Also: every message is this rank's, and its messages digest to the planner's ``part``."""
    who = f"{plan.side} rank {plan.rank}"
    for index, seen in plan.pieces.items():
        if index >= len(local):
            raise PlanError(f"{who}: the plan uses piece {index} ({seen.spec.name}), but this rank declared "
                            f"only {len(local)} pieces")
        mine = local[index]
        if mine != seen:
            raise PlanError(f"{who}: the plan was made for {seen.spec.name} {seen.spec.dtype} {list(seen.spec.shape)} "
                            f"box {seen.box} as piece {index}, but this rank holds {mine.spec.name} {mine.spec.dtype} "
                            f"{list(mine.spec.shape)} box {mine.box} there")
    source = plan.side == TRAIN
    for rounds, sends, what in ((plan.rounds, source, "message"), (plan.relay_in, False, "relay message"),
                                (plan.relay_out, True, "relay message")):
        for msgs in rounds:
            for m in msgs:
                if (m.src if sends else m.dst) != plan.rank:
                    raise PlanError(f"{who}: the plan hands it a {what} {m.src}->{m.dst} of another rank")
                for seg in (m.src_segments if sends else m.dst_segments):
                    _check_segment(who, seg, plan.pieces)
    for q in plan.receiver_quantizations:
        if q.dst != plan.rank or q.piece not in plan.pieces or q.scale_piece not in plan.pieces:
            raise PlanError(f"{who}: a receiver quantization of piece {q.piece} is not this rank's")
    digest = part_fingerprint(plan.rounds, plan.relay_in, plan.relay_out)
    if digest != plan.part:
        raise PlanError(f"{who}: its part of plan {plan.facts.fingerprint} digests to {digest} here but to {plan.part} "
                        "on the planner (train rank 0): every rank must run the same refit version")


def _check_segment(who: str, seg: Segment, pieces: dict[int, PieceMeta]) -> None:
    meta = pieces.get(seg.piece)
    if meta is None:
        raise PlanError(f"{who}: a segment uses piece {seg.piece}, which the plan does not describe")
    sizes = meta.box.sizes
    if seg.box.ndim != len(sizes) or not seg.box.within(sizes):
        raise PlanError(f"{who}: a segment {seg.box} of {meta.spec.name} lies outside its piece (sizes {list(sizes)})")
