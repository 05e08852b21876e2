"""A relay in slices (``RelayOptions.chunk_bytes``): a relayed replica forwards each slice of a round as soon as
that slice landed, before the rest of the round arrives. Real refits over gloo, a chain of 4 replicas."""

import pytest
from relay_ranks import relay_ranks

from refit_core.contract.options import RelayOptions
from refit_core.kit.launch import free_port, spawn
from refit_core.plan.relay import RelayPiece, chunk_spans, piece_bytes, relay_slices

CHAIN = {"replicas": 4, "direct": 1, "fanout": 1, "chunk_bytes": 700}
"""700 bytes: the toy's messages (up to 2 KiB, PIPELINED) are cut mid-message and mid-segment."""
PIPELINED = {"bucket_bytes": 1 << 12, "messages": {"direct_min_bytes": 1 << 11, "shared_max_bytes": 1 << 11}}


def test_relay_slices_cut_each_message_in_pieces_and_group_them_up_to_the_chunk():
    assert chunk_spans(1500, 700) == [(0, 700), (700, 1400), (1400, 1500)]
    assert chunk_spans(700, 700) == [(0, 700)] and chunk_spans(5, 0) == [(0, 5)]
    slices = relay_slices([1500, 200, 300], 700)
    assert slices == [[RelayPiece(0, 0, 700)], [RelayPiece(0, 700, 1400)],
                      [RelayPiece(0, 1400, 1500), RelayPiece(1, 0, 200), RelayPiece(2, 0, 300)]]
    assert relay_slices([1500, 200], 0) == [[RelayPiece(0, 0, 1500), RelayPiece(1, 0, 200)]]


def test_slices_in_pieces_spread_one_slice_over_several_operations():
    assert piece_bytes(700, 3) == 233 and piece_bytes(32 << 20, 8) == 4 << 20 and piece_bytes(0, 8) == 0
    assert piece_bytes(10_000, 2) == 4096  # pieces above 4 KiB are whole multiples of it
    assert relay_slices([1500, 200], 700, 2) == [[RelayPiece(0, 0, 350), RelayPiece(0, 350, 700)],
                                                 [RelayPiece(0, 700, 1050), RelayPiece(0, 1050, 1400)],
                                                 [RelayPiece(0, 1400, 1500), RelayPiece(1, 0, 200)]]


@pytest.mark.skipif("chunk_bytes" not in RelayOptions.__dataclass_fields__,
                    reason="RelayOptions.chunk_bytes is not wired to the planner and receiver yet")
@pytest.mark.parametrize(("mode", "pieces"), [("in_place", 1), ("staged", 3)])
def test_a_chain_in_slices_relays_bitwise_and_forwards_a_slice_before_its_round_landed(mode: str, pieces: int):
    chain = {**CHAIN, "slice_pieces": pieces}
    results = spawn(relay_ranks, 5, f"127.0.0.1:{free_port()}", 2, chain, None, 30.0, 1, 1,
                    {**PIPELINED, "mode": mode}, True, False, None, timeout_s=180)
    errors = [r for r in results if isinstance(r, tuple)]
    assert not errors, errors
    trainer, gens = results[0], results[1:]
    assert len({r["fingerprint"] for r in results}) == 1 and trainer["train_peers"] == [0]
    for gen in gens:
        assert [s["mismatches"] for s in gen["steps"]] == [[], []]
        assert [s["engine_version"] for s in gen["steps"]] == [100, 101]
    step_bytes = trainer["train_bytes"]  # every byte once per link, in slices or not
    for hop, gen in enumerate(gens):
        counted = gen["counters"][1]
        assert counted["received_bytes"] == 2 * step_bytes, (hop, counted)
        assert counted["sent_bytes"] == (0 if hop == 3 else 2 * step_bytes), (hop, counted)
    # a middle replica receives a round in several slices and forwards the first before the round's last landed
    for gen in gens[1:3]:
        for spans in gen["timelines"]:
            received: dict[int, list[float]] = {}
            for phase, index, _, end in spans:
                if phase == "transfer":
                    received.setdefault(index, []).append(end)
            sliced = [index for index, ends in received.items() if len(ends) > 1]
            assert sliced, spans
            assert any(start < max(received[index]) for phase, index, start, _ in spans
                       if phase == "forward" and index in sliced), spans
