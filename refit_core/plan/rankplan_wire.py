"""One rank's part of the plan as compact JSON, read back with every field checked, and its digest.

Messages travel as arrays, a segment as a run of integers in one flat list per message side
(``piece, offset, dtype, quant, scales_offset, ndim, *offsets, *sizes``; ``quant`` indexes the
record's table of quantizations, -1 for none), so a rank's record grows with its own messages only.
:func:`part_fingerprint` digests a rank's messages in that form.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from refit_core.contract.backend import GEN, TRAIN
from refit_core.contract.errors import WireError
from refit_core.contract.spec import Box, Quantization
from refit_core.plan.codec import (
    MAX_DIMS,
    MAX_EXTENT,
    dtype_from_wire,
    dtype_name,
    meta_from_wire,
    meta_to_wire,
    quant_from_wire,
    quant_to_wire,
)
from refit_core.plan.items import Message, ReceiverQuantization, Segment, SegmentScales
from refit_core.plan.links import Link
from refit_core.plan.rankplan_records import PlanFacts, RankPlan, RelayFacts, Rounds
from refit_core.plan.relay import RelayTree
from refit_core.plan.schedule import ScheduleSummary

FORMAT = 3
"""The record's layout version: a rank of another refit version fails with a named error."""


def part_fingerprint(rounds: Sequence[Sequence[Message]], relay_in: Sequence[Sequence[Message]] = (),
                     relay_out: Sequence[Sequence[Message]] = ()) -> str:
    """A digest of one rank's messages, segment by segment (scales included), round by round."""
    h = hashlib.sha256()
    dtypes: dict[torch.dtype, int] = {}
    quants: dict[Quantization, int] = {}
    for tag, part in (("r", rounds), ("i", relay_in), ("o", relay_out)):
        for msgs in part:
            h.update(f"|{tag}".encode())
            for m in msgs:
                h.update(repr(_message_record(m, dtypes, quants)).encode())
    h.update(repr(([dtype_name(d) for d in dtypes], [quant_to_wire(q) for q in quants])).encode())
    return h.hexdigest()[:16]


def _summary_to_wire(s: ScheduleSummary) -> list[int]:
    return [s.bytes, s.messages, s.segments, s.rounds, s.busiest_sender_bytes, s.busiest_receiver_bytes,
            s.peak_round_send_bytes, s.peak_round_recv_bytes]


def _segments_record(segs: Sequence[Segment], dtypes: dict[torch.dtype, int],
                     quants: dict[Quantization, int]) -> list[int]:
    out: list[int] = []
    for s in segs:
        d = dtypes.setdefault(s.dtype, len(dtypes))
        if s.scales is None:
            out += (s.piece, s.offset, d, -1, 0, s.box.ndim, *s.box.offsets, *s.box.sizes)
        else:
            q = quants.setdefault(s.scales.quant, len(quants))
            out += (s.piece, s.offset, d, q, s.scales.offset, s.box.ndim, *s.box.offsets, *s.box.sizes)
    return out


def _message_record(m: Message, dtypes: dict[torch.dtype, int], quants: dict[Quantization, int]) -> list[Any]:
    return [m.src, m.dst, m.nbytes, _segments_record(m.src_segments, dtypes, quants),
            _segments_record(m.dst_segments, dtypes, quants)]


def facts_to_wire(facts: PlanFacts) -> dict[str, Any]:
    relay = facts.relay
    return {"format": FORMAT, "fingerprint": facts.fingerprint, "num_src": facts.num_src, "num_dst": facts.num_dst,
            "bucket_bytes": facts.bucket_bytes, "summary": _summary_to_wire(facts.summary), "network": facts.network,
            "counts": facts.counts,
            "relay": None if relay is None else {
                "replica_size": relay.replica_size, "levels": [list(level) for level in relay.tree.levels],
                "parent": list(relay.tree.parent),
                "fingerprint": relay.fingerprint, "summary": _summary_to_wire(relay.summary),
                "node_ranks": relay.node_ranks}}


def to_wire(plan: RankPlan, facts_record: dict[str, Any] | None = None) -> dict[str, Any]:
    """``plan`` as a JSON record; ``facts_record`` is :func:`facts_to_wire`'s (encode it once for all ranks)."""
    dtypes: dict[torch.dtype, int] = {}
    quants: dict[Quantization, int] = {}

    def rounds(part: Rounds) -> list[list[list[Any]]]:
        return [[_message_record(m, dtypes, quants) for m in msgs] for msgs in part]

    record: dict[str, Any] = {
        "plan": facts_record if facts_record is not None else facts_to_wire(plan.facts),
        "side": plan.side, "rank": plan.rank, "part": plan.part,
        "rounds": rounds(plan.rounds), "relay_in": rounds(plan.relay_in), "relay_out": rounds(plan.relay_out),
        "links": [[src, dst, link.value] for (src, dst), link in sorted(plan.links.items())],
        "rq": [[q.dst, q.piece, q.scale_piece, quants.setdefault(q.quant, len(quants)),
                dtypes.setdefault(q.dtype, len(dtypes))] for q in plan.receiver_quantizations],
        "pieces": [[i, meta_to_wire(m)] for i, m in sorted(plan.pieces.items())],
        "experts": [[group, index, name] for (group, index), name in sorted(plan.experts.items())],
    }
    record["dtypes"] = [dtype_name(d) for d in dtypes]
    record["quants"] = [quant_to_wire(q) for q in quants]
    return record


class _Reader:
    """Strict parsing of one record, naming ``what`` (``"gen rank 3's plan"``) in every error."""

    def __init__(self, what: str) -> None:
        self.what = what

    def fail(self, problem: str) -> WireError:
        return WireError(f"{self.what}: {problem}")

    def field(self, record: Any, key: str, kind: type | tuple[type, ...]) -> Any:
        if not isinstance(record, dict) or key not in record:
            raise self.fail(f"missing field {key!r}")
        value = record[key]
        if not isinstance(value, kind) or (kind is int and type(value) is not int):
            raise self.fail(f"field {key!r} is {type(value).__name__}, not {getattr(kind, '__name__', kind)}")
        return value

    def int_(self, value: Any, what: str, lo: int = 0, hi: int = MAX_EXTENT) -> int:
        if type(value) is not int or not lo <= value <= hi:
            raise self.fail(f"{what} {value!r:.40} is not an integer in [{lo}, {hi}]")
        return value

    def ints(self, value: Any, what: str, n: int | None = None, lo: int = 0) -> list[int]:
        if not isinstance(value, list) or (n is not None and len(value) != n):
            raise self.fail(f"{what} is not a list{'' if n is None else f' of {n}'} integers")
        return [self.int_(v, what, lo) for v in value]

    def summary(self, value: Any) -> ScheduleSummary:
        return ScheduleSummary(*self.ints(value, "summary", 8))

    def fingerprint(self, value: Any, what: str) -> str:
        if not isinstance(value, str) or not 0 < len(value) <= 64 or not value.isalnum():
            raise self.fail(f"{what} {value!r:.80} is not a fingerprint")
        return value


def facts_from_wire(value: Any, what: str) -> PlanFacts:
    r = _Reader(what)
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        got = value.get("format") if isinstance(value, dict) else value
        raise WireError(f"{what}: plan record format {got!r:.40}, this rank reads format {FORMAT}: every rank "
                        "must run the same refit version")
    counts_in = r.field(value, "counts", dict)
    counts: dict[str, dict[str, int]] = {}
    for side in (TRAIN, GEN):
        groups = r.field(counts_in, side, dict)
        counts[side] = {str(k): r.int_(v, f"{side} expert count of {k!r:.80}", 1) for k, v in groups.items()}
    relay_in = value.get("relay")
    relay = None
    if relay_in is not None:
        parent = r.ints(r.field(relay_in, "parent", list), "relay parents", lo=-1)
        levels = tuple(tuple(r.ints(level, "relay level", lo=0)) for level in r.field(relay_in, "levels", list))
        relay = RelayFacts(r.int_(r.field(relay_in, "replica_size", int), "replica size", 1),
                           RelayTree(levels, tuple(parent)),
                           r.fingerprint(r.field(relay_in, "fingerprint", str), "relay fingerprint"),
                           r.summary(r.field(relay_in, "summary", list)),
                           r.int_(r.field(relay_in, "node_ranks", int), "node ranks", 0))
    return PlanFacts(r.fingerprint(r.field(value, "fingerprint", str), "fingerprint"),
                     r.int_(r.field(value, "num_src", int), "num_src", 1, 1 << 20),
                     r.int_(r.field(value, "num_dst", int), "num_dst", 1, 1 << 20),
                     r.int_(r.field(value, "bucket_bytes", int), "bucket_bytes", 1),
                     r.summary(r.field(value, "summary", list)), r.field(value, "network", bool), counts, relay)


def _segments_from_wire(r: _Reader, flat: Any, dtypes: list[torch.dtype], quants: list[Quantization],
                        what: str) -> tuple[Segment, ...]:
    if not isinstance(flat, list):
        raise r.fail(f"{what}: segments are not a list")
    out: list[Segment] = []
    i = 0
    while i < len(flat):
        head = flat[i:i + 6]
        if len(head) < 6:
            raise r.fail(f"{what}: a truncated segment")
        piece, offset, d, q, scales_at, ndim = (r.int_(v, f"{what} segment field", -1) for v in head)
        if not 0 <= ndim <= MAX_DIMS or i + 6 + 2 * ndim > len(flat):
            raise r.fail(f"{what}: a segment of {ndim} dimensions does not fit its record")
        offsets = tuple(r.int_(v, f"{what} offset") for v in flat[i + 6:i + 6 + ndim])
        sizes = tuple(r.int_(v, f"{what} size") for v in flat[i + 6 + ndim:i + 6 + 2 * ndim])
        if piece < 0 or offset < 0 or not 0 <= d < len(dtypes) or not -1 <= q < len(quants) or scales_at < 0:
            raise r.fail(f"{what}: segment fields {head} out of range")
        scales = SegmentScales(quants[q], scales_at) if q >= 0 else None
        out.append(Segment(piece, Box(offsets, sizes), offset, dtypes[d], scales))
        i += 6 + 2 * ndim
    return tuple(out)


def _rounds_from_wire(r: _Reader, value: Any, dtypes: list[torch.dtype], quants: list[Quantization],
                      facts: PlanFacts, gen_to_gen: bool, what: str) -> Rounds:
    if not isinstance(value, list):
        raise r.fail(f"{what} is not a list of rounds")
    rounds: Rounds = []
    num_src = facts.num_dst if gen_to_gen else facts.num_src
    for k, msgs in enumerate(value):
        if not isinstance(msgs, list):
            raise r.fail(f"{what} round {k} is not a list of messages")
        out = []
        for m in msgs:
            if not isinstance(m, list) or len(m) != 5:
                raise r.fail(f"{what} round {k}: a message is not [src, dst, nbytes, src_segments, dst_segments]")
            where = f"{what} round {k}"
            out.append(Message(r.int_(m[0], f"{where} src", 0, num_src - 1),
                               r.int_(m[1], f"{where} dst", 0, facts.num_dst - 1),
                               r.int_(m[2], f"{where} nbytes", 0, facts.bucket_bytes),
                               _segments_from_wire(r, m[3], dtypes, quants, where),
                               _segments_from_wire(r, m[4], dtypes, quants, where)))
        rounds.append(out)
    return rounds


def from_wire(value: Any, side: str, rank: int) -> RankPlan:
    """``side`` rank ``rank``'s record, every field checked; a :class:`~refit_core.contract.errors.WireError`
    names what is wrong."""
    what = f"{side} rank {rank}'s plan"
    r = _Reader(what)
    if not isinstance(value, dict):
        raise r.fail(f"expected a record, got {type(value).__name__}")
    facts = facts_from_wire(r.field(value, "plan", dict), what)
    if r.field(value, "side", str) != side or r.field(value, "rank", int) != rank:
        raise r.fail(f"the record is {value['side']!r:.20} rank {value['rank']!r:.20}'s")
    try:
        dtypes = [dtype_from_wire(d, None, what) for d in r.field(value, "dtypes", list)]
        quants = [quant_from_wire(q, f"{what} quantization") for q in r.field(value, "quants", list)]
    except ValueError as exc:
        raise r.fail(str(exc)) from None
    rounds = _rounds_from_wire(r, r.field(value, "rounds", list), dtypes, quants, facts, False, "rounds")
    relay_in = _rounds_from_wire(r, r.field(value, "relay_in", list), dtypes, quants, facts, True, "relay_in")
    relay_out = _rounds_from_wire(r, r.field(value, "relay_out", list), dtypes, quants, facts, True, "relay_out")
    links: dict[tuple[int, int], Link] = {}
    for entry in r.field(value, "links", list):
        if not isinstance(entry, list) or len(entry) != 3 or entry[2] not in {k.value for k in Link}:
            raise r.fail(f"link {entry!r:.80} is not [src, dst, kind]")
        links[(r.int_(entry[0], "link src"), r.int_(entry[1], "link dst"))] = Link(entry[2])
    quantizing = []
    for entry in r.field(value, "rq", list):
        dst, piece, scale_piece, q, d = r.ints(entry, "receiver quantization", 5)
        if not (q < len(quants) and d < len(dtypes)):
            raise r.fail(f"receiver quantization {entry} names no quantization or dtype of the record")
        quantizing.append(ReceiverQuantization(dst, piece, scale_piece, quants[q], dtypes[d]))
    pieces = {}
    for entry in r.field(value, "pieces", list):
        if not isinstance(entry, list) or len(entry) != 2:
            raise r.fail(f"piece {entry!r:.80} is not [index, piece]")
        pieces[r.int_(entry[0], "piece index")] = meta_from_wire(entry[1], f"{what} piece {entry[0]}")
    experts = {}
    for entry in r.field(value, "experts", list):
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(entry[i], str) for i in (0, 2))):
            raise r.fail(f"expert name {entry!r:.80} is not [group, index, name]")
        experts[(entry[0], r.int_(entry[1], "expert index"))] = entry[2]
    return RankPlan(side, rank, facts, rounds, links, tuple(quantizing), relay_in, relay_out, pieces, experts,
                    r.fingerprint(r.field(value, "part", str), "part fingerprint"))
