"""Subset steps: a sub-schedule of the static plan moves exactly the named tensors (:mod:`refit_core.plan.subset`)."""

from __future__ import annotations

import re

import pytest
import torch
from toy_ranks import TRAIN_RANKS, subset_ranks

from refit_core import RefitError
from refit_core.contract.experts import default_expert_name
from refit_core.contract.spec import Box, QuantizeStep, Quantization, QuantSite
from refit_core.kit.launch import free_port, spawn
from refit_core.plan.items import Message, Transfer
from refit_core.plan.schedule import build_schedule
from refit_core.plan.subset import (
    WHOLE,
    SubSchedules,
    Subset,
    difference,
    moved_bytes,
    narrow_message,
    subset_of,
)

GEN_RANKS = 3


def _transfer(name: str, piece: int, src: int, dst: int, rows: int, quantize: QuantizeStep | None = None) -> Transfer:
    box = Box((0, 0), (rows, 32))
    return Transfer(name, src, piece, box, dst, piece, box, torch.bfloat16 if quantize is None else torch.float8_e4m3fn,
                    quantize)


def toy_schedule():
    """Two train ranks into two gen ranks; five tensors (piece i is tensor NAMES[i] on both sides), one
    quantized on the sender (its scales land in piece 5), small buckets so messages mix tensors."""
    names = ["a", "b", "c", "d", "e"]
    fp8 = QuantizeStep(Quantization.block_fp8("e_scale", (16, 16)), QuantSite.SENDER, 5)
    transfers = [_transfer(n, i, src, dst, 16, fp8 if n == "e" else None)
                 for i, n in enumerate(names) for src in range(2) for dst in range(2)]
    return names + ["e_scale"], transfers, build_schedule(transfers, 2, 2, bucket_bytes=4096)


def _assert_laid_out(m: Message, names: list[str]) -> None:
    """Back to back from 0 (every segment aligned, no gap wider than the alignment), all values first, then
    the scales: the message's second wire part."""
    laid = sorted(m.dst_segments, key=lambda d: d.offset)
    ends = [0] + [d.offset + d.nbytes for d in laid]
    assert all(d.offset % 16 == 0 and 0 <= d.offset - end < 16 for d, end in zip(laid, ends))
    assert m.nbytes == ends[-1]
    scales = [d for d in laid if names[d.piece] == "e_scale"]
    assert laid[len(laid) - len(scales):] == scales
    assert m.parts == (((0, scales[0].offset), (scales[0].offset, m.nbytes)) if scales else ((0, m.nbytes),))


def test_a_sub_schedule_moves_exactly_the_named_tensors_bytes_laid_back_to_back():
    names, transfers, schedule = toy_schedule()
    subset = Subset.of(["b", "e"])
    total = 0
    for rank in range(2):
        for sender, rounds in ((True, schedule.rounds_of_source(rank)), (False, schedule.rounds_of_destination(rank))):
            subs = SubSchedules(rounds, names, sender=sender)
            sub = subs.rounds_for(subset)
            assert subs.rounds_for(subset) is sub and subs.derived == 1  # the repeat is a cache hit
            pieces = {names[s.piece] for msgs in sub for m in msgs
                      for s in (m.src_segments if sender else m.dst_segments)}
            assert pieces == ({"b", "e"} if sender else {"b", "e", "e_scale"})
            for m in (m for schedule_rounds in (rounds, sub) for msgs in schedule_rounds for m in msgs):
                _assert_laid_out(m, names)
            if not sender:
                total += moved_bytes(sub)
    fp8_scales = 2 * 4  # (16 / 16) x (32 / 16) float32 scales per transfer
    assert total == sum(t.src_box.numel * 2 if t.name == "b" else t.src_box.numel + fp8_scales
                        for t in transfers if t.name in subset.names)
    assert total < moved_bytes(schedule.rounds)


def test_a_message_wholly_kept_or_wholly_dropped_is_itself_or_nothing():
    _, _, schedule = toy_schedule()
    m = schedule.rounds[0][0]
    assert narrow_message(m, lambda s, d: True) is m
    assert narrow_message(m, lambda s, d: False) is None


def test_subset_steps_move_exactly_the_named_tensors_and_sides_that_disagree_fail_naming_the_difference():
    """Staged mode (the sub-schedule's landed step is committed from its own staging); the vLLM engine
    test runs subsets in place."""
    results = spawn(subset_ranks, TRAIN_RANKS + GEN_RANKS, f"127.0.0.1:{free_port()}", "staged", timeout_s=150)
    for r in results:
        whole, subset, again, last = r["bytes"]
        assert 0 < subset == again < whole == last  # a subset moves less, the same each time
        assert r["derived"] == 1  # the repeated subset was planned once
        assert r["freed_on_close"]  # no reference cycle keeps a closed endpoint (and the views it bound) alive
        kind, message, seconds = r["error"]
        assert "a subset of 3 tensor(s)" in message and "a subset of 2 tensor(s)" in message, message
        assert "moves model.layers.0.mlp.experts.up_proj.weight" in message, message  # names what differs
        assert kind == ("SubsetMismatchError" if r["side"] == "train" else "StepFailedError"), r["error"]
        assert seconds < 20, r["error"]  # at the headers, not at the 30 s deadline
    for r in (r for r in results if r["side"] == "gen"):
        assert r["mismatches"] == [[], [], [], []]  # named tensors fresh, the others as the last step left them
        assert r["version"] == 103
        assert r["after_error"] == []  # the refused step moved nothing


def test_a_subset_folds_experts_into_their_group_and_names_what_it_cannot_move():
    group = "model.layers.0.mlp.experts.up_proj.weight"
    groups, known = {group: 4}, {group, "model.norm.weight"}  # the planner's: what the train side sends
    experts = [f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4)]

    def of(names):
        return subset_of(names, default_expert_name, groups, known)

    assert of(experts).names == {group}
    assert of(experts) == of([group]) != of([group, "model.norm.weight"])
    assert subset_of(["anything"], default_expert_name, groups).names == {"anything"}  # not the planner: not known
    for names, message in [(experts[:3], f"names 3 of the 4 experts of {group} (missing: 3)"),
                           (["model.norm.weight", "lm_head.weight"], "1 tensor(s) the plan does not move: lm_head"),
                           ([], "a subset names at least one tensor")]:
        with pytest.raises(RefitError, match=re.escape(message)):
            of(names)


def test_the_difference_of_two_subsets_names_what_only_one_side_moves():
    a, b = Subset.of(["x", "y"]), Subset.of(["y", "z"])
    assert difference(a.digest, a.names, b.digest, b.names) == "only the peer moves x; only this rank moves z"
    assert difference(WHOLE, None, b.digest, b.names) == "this rank moves only y, z"
    assert difference(a.digest, None, b.digest, b.names) == "the peer's names are not known here"
