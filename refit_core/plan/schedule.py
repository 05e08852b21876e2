"""The static schedule: transfers cut into messages, messages placed in rounds, and its fingerprint.

A *message* is one contiguous buffer from one train rank to one gen rank: a list of segments laid
out back to back (16-byte aligned); :mod:`refit_core.plan.message_cutting` cuts them. A *round* is a set
of messages that run at once as one grouped point-to-point exchange; in every round each rank sends (or
receives) at most ``bucket_bytes`` in all, so the staging memory of a rank is bounded by ``bucket_bytes x
num_buffers``; :mod:`refit_core.plan.round_placement` places them. Every rank walks its rounds in
increasing order, so rounds never wait on each other in a cycle.

A step of small units only (no message above ``shared_max_bytes``: an adapter-only LoRA step) is placed in
rounds of at most ``shared_max_bytes`` instead (:func:`round_bytes`). Every such message is staged; in one
bucket-sized round a sender packed the whole step before its first byte left, and a receiver unpacked it after
its last byte came. In smaller rounds each round's copies overlap the transfers of its neighbours, as the
shared messages of a whole-model step overlap its large ones.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from refit_core.contract.options import MessageMode, MessageOptions
from refit_core.contract.spec import QuantSite
from refit_core.plan.items import ALIGN, Message, ReceiverQuantization, Transfer, align
from refit_core.plan.message_cutting import QUANTIZED_MESSAGE_SHARE, pair_messages
from refit_core.plan.round_placement import place_in_rounds

__all__ = ["QUANTIZED_MESSAGE_SHARE", "Schedule", "ScheduleSummary", "build_schedule", "digest_rounds", "round_bytes",
           "summarize"]

_place_in_rounds = place_in_rounds
"""Its name before :mod:`refit_core.plan.round_placement` (the docs and benchmark notes cite it)."""


@dataclass(frozen=True)
class ScheduleSummary:
    """What a schedule moves: totals, the busiest ranks, and the largest round per rank."""

    bytes: int
    messages: int
    segments: int
    rounds: int
    busiest_sender_bytes: int
    busiest_receiver_bytes: int
    peak_round_send_bytes: int
    peak_round_recv_bytes: int


@dataclass(frozen=True)
class Schedule:
    """The rounds of a refit, its fingerprint and its summary. A live setup's planner (train rank 0)
    holds every round; every other rank its own messages only (:mod:`refit_core.plan.rankplan`)."""

    num_src: int
    num_dst: int
    bucket_bytes: int
    rounds: list[list[Message]]
    fingerprint: str
    summary: ScheduleSummary
    receiver_quantizations: tuple[ReceiverQuantization, ...] = ()

    def receiver_quantizations_of(self, rank: int) -> list[ReceiverQuantization]:
        """The pieces gen rank ``rank`` quantizes itself (see :mod:`refit_core.plan.quant_rules`)."""
        return [q for q in self.receiver_quantizations if q.dst == rank]

    def rounds_of_source(self, rank: int) -> list[list[Message]]:
        """This train rank's messages, round by round (rounds it has no part in are skipped)."""
        picked = ([m for m in msgs if m.src == rank] for msgs in self.rounds)
        return [msgs for msgs in picked if msgs]

    def rounds_of_destination(self, rank: int) -> list[list[Message]]:
        picked = ([m for m in msgs if m.dst == rank] for msgs in self.rounds)
        return [msgs for msgs in picked if msgs]


def build_schedule(transfers: Sequence[Transfer], num_src: int, num_dst: int, bucket_bytes: int,
                   formation: MessageOptions | None = None, *, expert_groups: Collection[str] = (),
                   agreed_settings: str = "") -> Schedule:
    """Cut ``transfers`` into messages of at most ``bucket_bytes`` and place them in rounds.

    ``formation`` says how messages are formed (see the module doc); ``expert_groups`` names the
    grouped expert tensors whose siblings are interleaved expert by expert; ``agreed_settings``
    (:meth:`RefitOptions.digest <refit_core.contract.options.RefitOptions.digest>`) is hashed into the
    fingerprint with the rounds.
    """
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    formation = formation or MessageOptions()
    groups = frozenset(expert_groups)
    by_pair: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        by_pair[(t.src, t.dst)].append(t)
    per_pair = {pair: pair_messages(ts, bucket_bytes, formation, groups) for pair, ts in by_pair.items()}
    rounds = place_in_rounds(per_pair, round_bytes(per_pair, bucket_bytes, formation))
    quantizing = _receiver_quantizations(transfers)
    return Schedule(num_src, num_dst, bucket_bytes, rounds,
                    digest_rounds(num_src, num_dst, bucket_bytes, rounds, agreed_settings, quantizing),
                    summarize(rounds), quantizing)


def round_bytes(per_pair: dict[tuple[int, int], list[Message]], bucket_bytes: int, formation: MessageOptions) -> int:
    """The most bytes a rank moves per round and direction: ``shared_max_bytes`` for a step of small units that
    would fit one round of the bucket (an adapter-only LoRA step, see the module doc: its copies then overlap
    its transfers), else the bucket (in ``runs`` mode always the bucket). A larger step of small units already
    has rounds to overlap; cutting them finer only adds rounds (DeepSeek-V3 at ep=256: 17 -> 152)."""
    cap = min(bucket_bytes, formation.shared_max_bytes)
    if formation.mode is MessageMode.RUNS or cap == bucket_bytes:
        return bucket_bytes
    if any(align(m.nbytes) > cap for msgs in per_pair.values() for m in msgs):
        return bucket_bytes
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for (src, dst), msgs in per_pair.items():
        nbytes = sum(align(m.nbytes) for m in msgs)
        sent[src] += nbytes
        received[dst] += nbytes
    one_round = max(sent.values(), default=0) <= bucket_bytes and max(received.values(), default=0) <= bucket_bytes
    return cap if one_round else bucket_bytes


def _receiver_quantizations(transfers: Sequence[Transfer]) -> tuple[ReceiverQuantization, ...]:
    seen: dict[tuple[int, int], ReceiverQuantization] = {}
    for t in transfers:
        if t.quantize is not None and t.quantize.site is QuantSite.RECEIVER:
            seen.setdefault((t.dst, t.dst_piece), ReceiverQuantization(
                t.dst, t.dst_piece, t.quantize.scale_piece, t.quantize.quant, t.dtype))
    return tuple(seen[k] for k in sorted(seen))


def digest_rounds(num_src: int, num_dst: int, bucket_bytes: int, rounds: Sequence[Sequence[Message]],
                agreed_settings: str = "", receiver_quantizations: Sequence[ReceiverQuantization] = ()) -> str:
    """A digest of everything both sides must agree on: ranks, settings, every segment (what
    :attr:`Schedule.fingerprint` holds)."""
    h = hashlib.sha256(f"{num_src}/{num_dst}/{bucket_bytes}/{agreed_settings}".encode())
    text: dict[object, str] = {}  # the same tuples and dtypes recur: format each once

    def shown(value: object) -> str:
        if value not in text:
            text[value] = str(value)
        return text[value]

    # boxes recur as objects (the planner stamps one representative's boxes across its group):
    # their text is kept by identity for the call (every box lives in ``rounds`` until it returns)
    src_text: dict[int, str] = {}
    dst_text: dict[int, str] = {}
    for r, msgs in enumerate(rounds):
        for m in msgs:
            parts = [f"|{r}:{m.src}>{m.dst}:{m.nbytes}"]
            targets = iter(m.dst_segments)
            for s in m.src_segments:
                d = next(targets)
                src = src_text.get(id(s.box))
                if src is None:
                    src = src_text[id(s.box)] = shown(s.box.offsets) + shown(s.box.sizes)
                dst = dst_text.get(id(d.box))
                if dst is None:
                    dst = dst_text[id(d.box)] = shown(d.box.offsets)
                parts.append(f";{s.piece}{src}>{d.piece}{dst}@{s.offset}{shown(s.dtype)}")
                if s.scales is not None:  # quantized on the sender: the scales' segment follows
                    q, scale = s.scales, next(targets)
                    parts.append(f"q{q.quant.block}{q.quant.dtype}@{q.offset}>{scale.piece}{shown(scale.box.offsets)}")
            h.update("".join(parts).encode())  # sha256 of a concatenation: as if fed piece by piece
    for rq in receiver_quantizations:
        h.update(f"|rq{rq.dst}:{rq.piece}:{rq.scale_piece}{rq.quant.block}{rq.quant.dtype}{rq.dtype}".encode())
    return h.hexdigest()[:16]


def summarize(rounds: Sequence[Sequence[Message]]) -> ScheduleSummary:
    """Totals and peaks of ``rounds``."""
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    messages = segments = 0
    peak_send = peak_recv = 0
    for msgs in rounds:
        round_send: dict[int, int] = defaultdict(int)
        round_recv: dict[int, int] = defaultdict(int)
        for m in msgs:
            messages += 1
            segments += len(m.src_segments)
            sent[m.src] += m.nbytes
            received[m.dst] += m.nbytes
            round_send[m.src] += align(m.nbytes)
            round_recv[m.dst] += align(m.nbytes)
        peak_send = max([peak_send, *round_send.values()])
        peak_recv = max([peak_recv, *round_recv.values()])
    return ScheduleSummary(
        bytes=sum(sent.values()),
        messages=messages,
        segments=segments,
        rounds=len(rounds),
        busiest_sender_bytes=max(sent.values(), default=0),
        busiest_receiver_bytes=max(received.values(), default=0),
        peak_round_send_bytes=peak_send,
        peak_round_recv_bytes=peak_recv,
    )
