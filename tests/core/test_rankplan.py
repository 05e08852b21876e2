"""Each rank's own part of the plan: sliced once by the planner, sent as JSON, checked by the rank.

Real plans (``plan_with_relay``, the planner live setup runs) are sliced, encoded, decoded strictly and
compared with the whole schedule's view of that rank; bad records and plans that do not fit a rank's
pieces fail with named errors.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from refit_core.contract.backend import GEN, TRAIN
from refit_core.contract.errors import PlanError
from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, Quantization, TensorSpec
from refit_core.net.wire import WireError, decode, encode
from refit_core.plan import rankplan
from refit_core.plan.links import Link
from refit_core.plan.planning import plan_with_relay
from refit_core.plan.schedule import Schedule

E4M3 = torch.float8_e4m3fn


def _rows(spec: TensorSpec, parts: int) -> list[list[PieceMeta]]:
    rows = spec.shape[0] // parts
    return [[PieceMeta(spec, Box((r * rows, 0), (rows, spec.shape[1])))] for r in range(parts)]


def _parts(train: list[list[PieceMeta]], gen: list[list[PieceMeta]], **options) -> tuple[Schedule, list]:
    """The whole schedule and every rank's part, through JSON (as live setup publishes them)."""
    settings = RefitOptions(bucket_bytes=1 << 12, **options).resolved("cpu")
    schedule, relay = plan_with_relay(train, gen, settings)
    links = {(m.src, m.dst): Link.NETWORK for msgs in schedule.rounds for m in msgs}
    facts = rankplan.PlanFacts(schedule.fingerprint, len(train), len(gen), schedule.bucket_bytes, schedule.summary,
                               True, {TRAIN: {}, GEN: {}},
                               None if relay is None else rankplan.RelayFacts(
                                   relay.replica_size, relay.tree, relay.schedule.fingerprint,
                                   relay.schedule.summary))
    record = rankplan.facts_to_wire(facts)
    parts = []
    for part in rankplan.rank_plans(facts, schedule, relay, links, {TRAIN: train, GEN: gen}, {}):
        received = rankplan.from_wire(decode(encode(rankplan.to_wire(part, record)), "test"), part.side, part.rank)
        assert received == part
        parts.append(received)
    return schedule, parts


def test_every_rank_gets_exactly_its_own_messages_and_they_check_against_its_pieces():
    w = TensorSpec("w", (64, 32), torch.float32)
    b = TensorSpec("b", (64, 8), torch.bfloat16)
    train = [a + c for a, c in zip(_rows(w, 4), _rows(b, 4))]
    gen = [a + c for a, c in zip(_rows(w, 2), _rows(b, 2))]
    schedule, parts = _parts(train, gen)
    assert [(p.side, p.rank) for p in parts] == [(TRAIN, r) for r in range(4)] + [(GEN, r) for r in range(2)]
    for p in parts:
        mine = p.schedule()
        whole = (schedule.rounds_of_source if p.side == TRAIN else schedule.rounds_of_destination)(p.rank)
        assert (mine.rounds_of_source if p.side == TRAIN else mine.rounds_of_destination)(p.rank) == whole
        assert whole and mine.fingerprint == schedule.fingerprint and mine.summary == schedule.summary
        rankplan.check_against(p, (train if p.side == TRAIN else gen)[p.rank])
    assert sum(len(m) for p in parts if p.side == GEN for m in p.rounds) == schedule.summary.messages


def test_sender_quantized_segments_and_receiver_quantizations_survive_the_wire():
    block = Quantization.block_fp8("w_scale_inv", (4, 4))
    w16, w8 = TensorSpec("w", (8, 8), torch.bfloat16), TensorSpec("w", (8, 8), E4M3, block)
    scale = block.scale_spec((8, 8))
    dst = [PieceMeta(w8, Box((0, 0), (8, 8))), PieceMeta(scale, block.scale_box(Box((0, 0), (8, 8))))]
    _, parts = _parts(_rows(w16, 2), [dst])  # whole blocks per sender: quantized in the pack step
    sent = [s for p in parts if p.side == TRAIN for msgs in p.rounds for m in msgs for s in m.src_segments]
    assert sent and all(s.scales is not None and s.scales.quant == block and s.dtype == E4M3 for s in sent)
    rows = [[PieceMeta(w16, Box((0, 0), (2, 8)))], [PieceMeta(w16, Box((2, 0), (6, 8)))]]
    _, parts = _parts(rows, [dst])  # a sender's rows split blocks: the gen rank quantizes itself
    (gen,) = [p for p in parts if p.side == GEN]
    quantizing = [(q.piece, q.scale_piece, q.quant, q.dtype) for q in gen.receiver_quantizations]
    assert quantizing == [(0, 1, block, torch.bfloat16)]
    rankplan.check_against(gen, dst)


def test_relayed_ranks_get_their_incoming_and_outgoing_relay_messages():
    spec = TensorSpec("w", (8, 4), torch.float32)
    gen = [[PieceMeta(spec, Box((0, 0), (8, 4)))]] * 4
    _, parts = _parts([[PieceMeta(spec, Box((0, 0), (8, 4)))]], gen, relay={"replicas": 4, "direct": 1, "fanout": 1})
    by_rank = {p.rank: p for p in parts if p.side == GEN}
    assert by_rank[0].rounds and not by_rank[0].relay_in and by_rank[0].relay_out  # fed by the trainer, forwards
    assert not by_rank[3].rounds and by_rank[3].relay_in and not by_rank[3].relay_out  # the chain's end
    relay = by_rank[1].relay_plan()
    assert relay is not None and relay.tree.parent == (-1, 0, 1, 2)
    assert relay.schedule.rounds_of_destination(1) == by_rank[1].relay_in
    assert relay.schedule.rounds_of_source(1) == by_rank[1].relay_out


def test_a_plan_made_for_other_pieces_is_a_plan_error_naming_the_tensor():
    spec = TensorSpec("layers.0.w", (16, 8), torch.float32)
    train, gen = _rows(spec, 2), _rows(spec, 1)
    _, parts = _parts(train, gen)
    (receiver,) = [p for p in parts if p.side == GEN]
    other = [PieceMeta(dataclasses.replace(spec, dtype=torch.float16), gen[0][0].box)]
    with pytest.raises(PlanError, match=r"gen rank 0: the plan was made for layers\.0\.w torch\.float32"):
        rankplan.check_against(receiver, other)
    with pytest.raises(PlanError, match="uses piece 0 .layers.0.w., but this rank declared only 0 pieces"):
        rankplan.check_against(receiver, [])
    sender = parts[0]
    first = sender.rounds[0][0]
    outside = dataclasses.replace(first.src_segments[0], box=Box((0, 0), (9, 8)))  # the piece has 8 rows
    bad = dataclasses.replace(sender, rounds=[[dataclasses.replace(first, src_segments=(outside,))]])
    with pytest.raises(PlanError, match=r"layers\.0\.w lies outside its piece"):
        rankplan.check_against(bad, train[0])
    with pytest.raises(PlanError, match="digests to .* here but to .* on the planner"):
        rankplan.check_against(dataclasses.replace(sender, rounds=sender.rounds[:0]), train[0])
    foreign = dataclasses.replace(sender, rounds=parts[1].rounds)
    with pytest.raises(PlanError, match="a message 1->0 of another rank"):
        rankplan.check_against(foreign, train[0])


def test_malformed_records_are_named_wire_errors():
    spec = TensorSpec("w", (16, 8), torch.float32)
    _, parts = _parts(_rows(spec, 2), _rows(spec, 1))
    good = json.loads(encode(rankplan.to_wire(parts[0])))

    def broken(change) -> dict:
        record = json.loads(json.dumps(good))
        change(record)
        return record

    cases = [
        (lambda r: r["plan"].update(format=99), "plan record format 99"),
        (lambda r: r.update(rank=1), "the record is 'train' rank 1's"),
        (lambda r: r["rounds"][0][0].__setitem__(0, 7), "src 7 is not an integer in"),
        (lambda r: r["rounds"][0][0][3].__setitem__(5, 40), "a segment of 40 dimensions"),
        (lambda r: r["rounds"][0][0][3].__setitem__(2, 5), "out of range"),
        (lambda r: r["dtypes"].__setitem__(0, "os.system"), "os.system"),
        (lambda r: r.update(pieces=[[0, {"name": "w"}]]), "expected a piece record"),
        (lambda r: r.update(links=[[0, 0, "telepathy"]]), "is not \\[src, dst, kind\\]"),
        (lambda r: r.update(part=["x"]), "field 'part' is list"),
    ]
    for change, match in cases:
        with pytest.raises(WireError, match=match):
            rankplan.from_wire(broken(change), TRAIN, 0)


def test_a_ranks_record_grows_with_its_own_messages_not_with_the_world():
    spec = TensorSpec("w", (256, 16), torch.float32)

    def record_bytes(world: int) -> int:  # every gen rank holds the whole tensor, from one train rank's rows
        _, parts = _parts(_rows(spec, 2), [[PieceMeta(spec, Box((0, 0), (256, 16)))]] * world)
        return len(encode(rankplan.to_wire(parts[-1])))

    small, large = record_bytes(2), record_bytes(64)
    assert small < large < small + 40, (small, large)  # only the digits of ranks and totals grow
