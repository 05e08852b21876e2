"""The dtype decisions of quantized destinations, and where quantization happens.

Checked at setup, before any collective, for every tensor:

- a quantized destination fed by a high-precision source (fp32 / bf16 / fp16) is *quantized*; its
  scale tensor then has no source: it is computed. The destination must hold whole blocks in every
  piece, and give every piece of the values a piece of the scales with exactly its blocks;
- a quantized destination fed by a source with the same quantization moves FP8 values and scales as
  bytes (FP8 -> FP8: the scales are ordinary tensors with sources of their own);
- a float8 destination without a quantization, a quantized source into a plain destination
  (dequantization) and different quantizations on the two sides are refused.

Where quantization happens is decided per tensor (:func:`assign_sites`): on the sender, inside the
pack step, when every transfer of the tensor consists of whole blocks (then the sender holds every
block it quantizes; the schedule cuts messages on block boundaries); else on the receiver, after
the high-precision bytes of its pieces landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from refit_core.contract.errors import PlanError
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import FP8_DTYPES, Box, Quantization, QuantizeStep, QuantSite, TensorSpec
from refit_core.plan.items import Transfer

HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
_MAX_LISTED = 5


@dataclass(frozen=True)
class QuantRule:
    """The decision for one quantized destination tensor."""

    name: str
    quant: Quantization
    source_dtype: torch.dtype
    quantize: bool
    """True: computed from high-precision weights; False: FP8 -> FP8, moved as bytes."""


def _listing(items: list[str]) -> str:
    shown = "; ".join(items[:_MAX_LISTED])
    return shown + (f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def quantization_rules(src: dict[str, TensorSpec], dst: dict[str, TensorSpec]) -> dict[str, QuantRule]:
    """Check every dtype decision that involves FP8; the rules of the quantized destinations."""
    rules: dict[str, QuantRule] = {}
    problems: list[str] = []
    for name, d in dst.items():
        s = src.get(name)
        if d.quant is None:
            if s is not None and s.quant is not None:
                problems.append(f"{name}: the source holds {s.quant.describe()} values but the destination "
                                f"wants plain {d.dtype} (dequantization is not supported)")
            elif d.dtype in FP8_DTYPES and (s is None or s.dtype != d.dtype):
                problems.append(f"{name}: destination is {d.dtype} without a quantization (no scales); "
                                "declare its Quantization in the TensorSpec")
            continue
        scale = dst.get(d.quant.scale_name)
        expected = d.quant.scale_spec(d.shape)
        if scale is None:
            problems.append(f"{name}: the destination declares no pieces of its scale tensor {d.quant.scale_name}")
        elif (scale.shape, scale.dtype) != (expected.shape, expected.dtype):
            problems.append(f"{name}: scale tensor {scale.name} is {scale.shape} {scale.dtype}, its "
                            f"{d.quant.describe()} needs {expected.shape} {expected.dtype}")
        if s is None:
            continue  # reported as a missing source by the planner
        if s.quant is not None:
            if s.quant != d.quant:
                problems.append(f"{name}: source holds {s.quant.describe()} (scales {s.quant.scale_name}), "
                                f"destination wants {d.quant.describe()} (scales {d.quant.scale_name})")
            else:
                rules[name] = QuantRule(name, d.quant, s.dtype, quantize=False)
        elif s.dtype not in HIGH_PRECISION:
            problems.append(f"{name}: cannot quantize a {s.dtype} source to {d.quant.describe()}")
        elif d.quant.scale_name in src:
            problems.append(f"{name}: the source holds plain values but also a tensor {d.quant.scale_name} "
                            "named like the destination's scales")
        else:
            rules[name] = QuantRule(name, d.quant, s.dtype, quantize=True)
    if problems:
        raise PlanError(f"{len(problems)} FP8 dtype problem(s): {_listing(problems)}")
    return rules


def computed_scales(rules: dict[str, QuantRule]) -> dict[str, QuantRule]:
    """Scale tensor name -> the rule of the values it scales, for scales computed by refit."""
    return {r.quant.scale_name: r for r in rules.values() if r.quantize}


def _scale_pieces(rule: QuantRule, dst_ranks: Sequence[Sequence[PieceMeta]],
                  shape: tuple[int, ...]) -> dict[tuple[int, int], int]:
    """(gen rank, values piece) -> index of the scale piece holding exactly its blocks' scales."""
    quant = rule.quant
    found: dict[tuple[int, int], int] = {}
    problems = []
    for rank, metas in enumerate(dst_ranks):
        scales = {m.box: i for i, m in enumerate(metas) if m.spec.name == quant.scale_name}
        used = set()
        for index, meta in enumerate(metas):
            if meta.spec.name != rule.name or not meta.box.numel:
                continue
            if not quant.aligned(meta.box, shape):
                problems.append(f"gen rank {rank} holds {rule.name}{meta.box}, which splits "
                                f"its {quant.describe()} (a rank must hold whole blocks)")
                continue
            want = quant.scale_box(meta.box)
            if want not in scales:
                problems.append(f"gen rank {rank} holds {rule.name}{meta.box} but no piece {quant.scale_name}{want} "
                                "for its scales")
                continue
            found[(rank, index)] = scales[want]
            used.add(want)
        extra = [f"{quant.scale_name}{box}" for box in scales if box not in used and box.numel]
        if extra:
            problems.append(f"gen rank {rank} holds scale pieces {extra[:3]} without the values they scale")
    if problems:
        raise PlanError(f"{len(problems)} quantized destination problem(s): {_listing(problems)}")
    return found


def assign_sites(transfers: list[Transfer], rules: dict[str, QuantRule],
                 dst_ranks: Sequence[Sequence[PieceMeta]], dst_specs: dict[str, TensorSpec]) -> list[Transfer]:
    """Give every transfer of a quantized tensor its :class:`QuantizeStep` and wire dtype."""
    by_name: dict[str, list[int]] = {}
    for i, t in enumerate(transfers):
        if t.name in rules and rules[t.name].quantize:
            by_name.setdefault(t.name, []).append(i)
    out = list(transfers)
    for name, rule in rules.items():
        if not rule.quantize:
            continue
        shape = dst_specs[name].shape
        scale_of = _scale_pieces(rule, dst_ranks, shape)
        indices = by_name.get(name, [])
        whole_blocks = all(
            rule.quant.aligned(_absolute(transfers[i], dst_ranks), shape) for i in indices)
        site = QuantSite.SENDER if whole_blocks else QuantSite.RECEIVER
        dtype = rule.quant.dtype if site is QuantSite.SENDER else rule.source_dtype
        for i in indices:
            t = transfers[i]
            step = QuantizeStep(rule.quant, site, scale_of[(t.dst, t.dst_piece)])
            out[i] = replace(t, dtype=dtype, quantize=step)
    return out


def _absolute(t: Transfer, dst_ranks: Sequence[Sequence[PieceMeta]]) -> Box:
    """A transfer's destination region in the coordinates of the whole tensor."""
    piece = dst_ranks[t.dst][t.dst_piece].box
    return Box(tuple(a + b for a, b in zip(piece.offsets, t.dst_box.offsets)), t.dst_box.sizes)
