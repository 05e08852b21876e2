"""The quantizers and the plan's FP8 decisions, without processes: fast vs reference bit for bit,
quantization geometry, every dtype decision refused or accepted at planning time."""

from __future__ import annotations

import re

import pytest
import torch

from refit_core.contract.errors import PlanError
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, Quantization, QuantScheme, QuantSite, TensorSpec
from refit_core.apps import same_bytes
from refit_core.plan.reference import plan_transfers
from refit_core.plan.schedule import QUANTIZED_MESSAGE_SHARE, build_schedule
from refit_core.run.quant.fast import Quantizer
from refit_core.run.quant.reference import dequantize, reference_quantize

E4M3 = torch.float8_e4m3fn


QUANTS = [
    ("block 128", Quantization.block_fp8("s", (128, 128)), (300, 200)),
    ("block 32 clipped", Quantization.block_fp8("s", (32, 32)), (70, 45)),
    ("block experts", Quantization.block_fp8("s", (16, 32), experts=True), (3, 40, 64)),
    ("per-channel", Quantization.per_channel("s", (33, 50)), (33, 50)),
    ("per-tensor", Quantization.per_tensor("s", (33, 50)), (33, 50)),
    ("per-tensor experts", Quantization.per_tensor("s", (4, 8, 16), experts=True), (4, 8, 16)),
    ("e5m2", Quantization.block_fp8("s", (8, 8), dtype=torch.float8_e5m2), (24, 20)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("label,quant,shape", QUANTS, ids=[q[0] for q in QUANTS])
def test_fast_quantizer_matches_the_reference_bitwise(label, quant, shape, dtype):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])).to(dtype)
    x[(0,) * (len(shape) - 2)][:4, :4] = 0  # an all-zero corner (a zero block for small blocks)
    values, scales = reference_quantize(x, quant)
    fast_values, fast_scales = Quantizer(compiled=False).quantize(x, quant)
    assert same_bytes(values, fast_values) and same_bytes(scales, fast_scales)
    assert scales.shape == quant.scale_shape(shape) and values.dtype == quant.dtype
    error = (dequantize(values, scales, quant) - x.float()).abs()
    block_scale = dequantize(torch.ones(shape).to(quant.dtype), scales, quant)
    mantissa = 3 if quant.dtype == E4M3 else 2
    assert torch.all(error <= x.float().abs() * 2.0 ** -mantissa + block_scale * 2.0 ** -8)


def test_fast_quantizer_reads_strided_views_in_place():
    """The sender quantizes strided views of fused parameters (a row block of a QKV, w13[:, :I])."""
    quant = Quantization.block_fp8("s", (16, 16), experts=True)
    fused = torch.randn(3, 64, 48, dtype=torch.bfloat16)
    view = fused[:, 32:]
    values = torch.empty(view.shape, dtype=E4M3)
    scales = torch.empty(quant.scale_shape(tuple(view.shape)))
    Quantizer(compiled=False).quantize_into(view, values, scales, quant)
    want_values, want_scales = reference_quantize(view.contiguous(), quant)
    assert same_bytes(values, want_values) and same_bytes(scales, want_scales)


def test_geometry():
    quant = Quantization.block_fp8("w_scale_inv")
    assert quant.scheme is QuantScheme.BLOCK and quant.scale_shape((4096, 14336)) == (32, 112)
    assert quant.scale_shape((200, 130)) == (2, 2)
    assert quant.aligned(Box((128, 0), (72, 130)), (200, 130))  # ends at the tensor's end
    assert not quant.aligned(Box((64, 0), (64, 130)), (200, 130))
    assert quant.scale_box(Box((128, 0), (72, 130))) == Box((1, 0), (1, 2))
    with pytest.raises(ValueError, match="block boundary"):
        quant.scale_box(Box((64, 0), (64, 128)))
    assert quant.stacked("e_scale").block == (1, 128, 128)
    with pytest.raises(ValueError, match="quantized dtype"):
        Quantization(QuantScheme.BLOCK, (2, 2), "s", torch.bfloat16)
    with pytest.raises(ValueError, match="differs from its quantization"):
        TensorSpec("w", (4, 4), torch.bfloat16, quant)


# -- planning ------------------------------------------------------------------------------------

BLOCK = Quantization.block_fp8("w_scale_inv", (4, 4))
W16 = TensorSpec("w", (8, 8), torch.bfloat16)
W8 = TensorSpec("w", (8, 8), E4M3, BLOCK)
S = BLOCK.scale_spec((8, 8))


def _rows(spec: TensorSpec, *cuts: int) -> list[PieceMeta]:
    edges = [0, *cuts, spec.shape[0]]
    return [PieceMeta(spec, Box((a, 0), (b - a, spec.shape[1]))) for a, b in zip(edges, edges[1:])]


def _dst(rows: int = 8) -> list[PieceMeta]:
    w = PieceMeta(W8, Box((0, 0), (rows, 8)))
    return [w, PieceMeta(S, BLOCK.scale_box(w.box))]


def test_sender_quantizes_when_every_transfer_holds_whole_blocks():
    transfers = plan_transfers([_rows(W16, 4)], [_dst()])
    assert [t.quantize.site for t in transfers] == [QuantSite.SENDER] * 2
    assert all(t.dtype == E4M3 and t.quantize.scale_piece == 1 for t in transfers)
    schedule = build_schedule(transfers, 1, 1, 1 << 20)
    (message,) = [m for msgs in schedule.rounds for m in msgs]
    assert [s.scales is not None for s in message.src_segments] == [True, True]
    assert [s.piece for s in message.dst_segments] == [0, 1, 0, 1]  # values, then their scales
    assert schedule.receiver_quantizations == ()


def test_receiver_quantizes_when_a_transfer_splits_blocks():
    transfers = plan_transfers([_rows(W16, 2)], [_dst()])
    assert {t.quantize.site for t in transfers} == {QuantSite.RECEIVER}
    assert all(t.dtype == torch.bfloat16 for t in transfers)  # high precision on the wire
    schedule = build_schedule(transfers, 1, 1, 1 << 20)
    (item,) = schedule.receiver_quantizations
    assert (item.piece, item.scale_piece, item.dtype) == (0, 1, torch.bfloat16)


def test_small_buckets_cut_on_block_boundaries():
    big16 = TensorSpec("w", (64, 64), torch.bfloat16)
    big8 = TensorSpec("w", (64, 64), E4M3, BLOCK)
    scale = BLOCK.scale_spec((64, 64))
    dst = [PieceMeta(big8, Box((0, 0), (64, 64))), PieceMeta(scale, Box((0, 0), (16, 16)))]
    schedule = build_schedule(plan_transfers([[PieceMeta(big16, Box((0, 0), (64, 64)))]], [dst]), 1, 1, 512)
    boxes = [s.box for msgs in schedule.rounds for m in msgs for s in m.src_segments]
    assert len(boxes) > 8 and all(m.nbytes <= 512 for msgs in schedule.rounds for m in msgs)
    assert all(o % 4 == 0 for b in boxes for o in b.offsets)
    assert sum(b.numel for b in boxes) == 64 * 64


def test_a_quantizing_pair_cuts_messages_to_a_quarter_of_the_bucket_along_a_block_row():
    row16, row8 = TensorSpec("w", (4, 64), torch.bfloat16), TensorSpec("w", (4, 64), E4M3, BLOCK)
    dst = [PieceMeta(row8, Box((0, 0), (4, 64))), PieceMeta(BLOCK.scale_spec((4, 64)), Box((0, 0), (1, 16)))]
    schedule = build_schedule(plan_transfers([[PieceMeta(row16, Box((0, 0), (4, 64)))]], [dst]), 1, 1, 512)
    messages = [m for msgs in schedule.rounds for m in msgs]
    assert all(m.nbytes <= 512 // QUANTIZED_MESSAGE_SHARE for m in messages)
    assert [s.box for m in messages for s in m.src_segments] == [Box((0, c), (4, 16)) for c in range(0, 64, 16)]
    plain = TensorSpec("w", (4, 64), torch.bfloat16)  # no quantizing sender: bucket-sized messages
    (whole,) = build_schedule(plan_transfers([[PieceMeta(plain, Box((0, 0), (4, 64)))]],
                                             [[PieceMeta(plain, Box((0, 0), (4, 64)))]]), 1, 1, 512).rounds
    assert [m.nbytes for m in whole] == [512]


def test_strict_cast_policy_still_quantizes_declared_destinations():
    assert plan_transfers([_rows(W16)], [_dst()], cast="strict")


@pytest.mark.parametrize("dst,message", [
    ([PieceMeta(TensorSpec("w", (8, 8), E4M3), Box((0, 0), (8, 8)))], "without a quantization"),
    ([PieceMeta(W8, Box((0, 0), (8, 8)))], "declares no pieces of its scale tensor w_scale_inv"),
    ([PieceMeta(W8, Box((0, 0), (8, 8))), PieceMeta(TensorSpec("w_scale_inv", (4, 2), torch.float32),
                                                   Box((0, 0), (4, 2)))], "needs (2, 2) torch.float32"),
    ([PieceMeta(W8, Box((0, 0), (6, 8))), PieceMeta(W8, Box((6, 0), (2, 8))), PieceMeta(S, Box((0, 0), (2, 2)))],
     "holds w[0:6, 0:8], which splits its block"),
])
def test_bad_quantized_destinations_are_refused_naming_the_tensor(dst, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        plan_transfers([_rows(W16)], [dst])


def test_dequantization_and_non_float_sources_are_refused():
    fp8_source = [PieceMeta(W8, Box((0, 0), (8, 8))), PieceMeta(S, Box((0, 0), (2, 2)))]
    with pytest.raises(PlanError, match="dequantization is not supported"):
        plan_transfers([fp8_source], [_rows(W16)], allow_unused_sources=True)
    ints = TensorSpec("w", (8, 8), torch.int32)
    with pytest.raises(PlanError, match="cannot quantize a torch.int32 source"):
        plan_transfers([_rows(ints)], [_dst()])


def test_fp8_to_fp8_moves_values_and_scales_as_plain_tensors():
    source = [PieceMeta(W8, Box((0, 0), (8, 8))), PieceMeta(S, Box((0, 0), (2, 2)))]
    transfers = plan_transfers([source], [_dst()])
    assert sorted(t.name for t in transfers) == ["w", "w_scale_inv"]
    assert all(t.quantize is None for t in transfers)


@pytest.mark.slow
def test_compiled_quantizer_matches_the_reference_bitwise():
    """The compiled kernel (what CUDA runs; here inductor's CPU backend) on strided 2-D and 3-D views."""
    quantizer = Quantizer(compiled=True)
    for quant, shape in ((Quantization.block_fp8("s", (32, 32)), (96, 70)),
                         (Quantization.block_fp8("s", (32, 32), experts=True), (3, 64, 40))):
        base = torch.randn(shape[0] * 2, *shape[1:], dtype=torch.bfloat16)
        view = base[shape[0]:]
        values, scales = quantizer.quantize(view, quant)
        want_values, want_scales = reference_quantize(view, quant)
        assert same_bytes(values, want_values) and same_bytes(scales, want_scales)
