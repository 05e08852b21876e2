"""Merged-mode LoRA in the pack step: ``W + scale * B @ A`` for each box a sender stages, never a merged model.

PEFT's ``merge_and_unload()`` (``LoraLayer.merge`` with ``get_delta_weight``, peft 0.21) computes, per
adapted ``nn.Linear``::

    delta = (B @ A) * scaling            # in B's dtype; on CPU, bf16/fp16 factors are upcast to fp32
    delta = delta.to(B.dtype)            # (only after that upcast)
    W += delta                           # in place: computed in the promoted dtype, stored in W's

:func:`lora_delta` and :func:`merged_box` repeat exactly that, for the rows and columns of one box:
``B[rows] @ A[:, cols]`` holds the same sums as ``(B @ A)[rows, cols]`` (each element is one dot
product over the rank). On CPU the sliced products are bitwise equal to the whole one (tested);
a GPU GEMM may pick another kernel for another shape, so there it is equal to PEFT's up to that.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from refit_core.contract.errors import TransferError
from refit_core.contract.lora import LoraFactors, LoraMerge
from refit_core.contract.spec import dtype_size

_HALF = (torch.float16, torch.bfloat16)


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """PEFT's ``get_delta_weight``: ``(b @ a) * scale`` in ``b``'s dtype (upcast to fp32 on CPU for
    half-precision factors, as PEFT does)."""
    upcast = b.device.type == "cpu" and b.dtype in _HALF
    if upcast:
        delta = (b.float() @ a.float()) * scale
        return delta.to(b.dtype)
    return (b @ a) * scale


def merged_box(weight: torch.Tensor, factors: LoraFactors, scale: float, rows: slice, cols: slice) -> torch.Tensor:
    """``weight`` (the base weight's box ``[rows, cols]``) plus the adapter's delta over that box, in
    ``weight``'s dtype: what ``merge_and_unload()`` leaves there."""
    delta = lora_delta(factors.a[:, cols], factors.b[rows], scale)
    return torch.add(weight, delta).to(weight.dtype)


@dataclass(frozen=True)
class BoxToMerge:
    """One merged segment of a staged message: its base-weight box and where its bytes go."""

    source: torch.Tensor
    """The box of the base weight ``W`` (a view of the trainer's local shard)."""
    merge: LoraMerge
    rows: slice
    """The box's rows and columns in the whole ``W``."""
    cols: slice
    dtype: torch.dtype
    """The wire dtype and the staged layout: ``sizes``, element ``strides``, byte ``offset``."""
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


class MergeBatch:
    """Merges a fixed list of boxes into a staging buffer, from the factors gathered for the step."""

    def __init__(self, boxes: Sequence[BoxToMerge]) -> None:
        self.boxes = list(boxes)

    def run(self, buffer: torch.Tensor, factors: Mapping[str, LoraFactors] | None) -> None:
        if factors is None:
            raise TransferError("refit bug: a merged-mode step packs before its adapters were gathered")
        typed: dict[torch.dtype, torch.Tensor] = {}
        for box in self.boxes:
            flat = typed.get(box.dtype)
            if flat is None:
                flat = typed[box.dtype] = buffer.view(box.dtype)
            staged = flat.as_strided(box.sizes, box.strides, box.offset // dtype_size(box.dtype))
            module = factors.get(box.merge.module)
            if module is None:
                raise TransferError(f"merged mode: no adapter was gathered for {box.merge.module}")
            staged.copy_(merged_box(box.source, module, box.merge.scale, box.rows, box.cols))


@dataclass(frozen=True)
class MergeTiming:
    """What :func:`time_merge` measured: the merge of one ``out x in`` box at rank ``rank``."""

    out_features: int
    in_features: int
    rank: int
    dtype: torch.dtype
    seconds: float
    """The median of the repeats, merge only (delta, add, cast)."""

    @property
    def gbps(self) -> float:
        """Base-weight bytes merged per second, in GB/s."""
        return self.out_features * self.in_features * dtype_size(self.dtype) / self.seconds / 1e9

    def line(self) -> str:
        return (f"merge of a {self.out_features}x{self.in_features} {str(self.dtype).removeprefix('torch.')} "
                f"box at r={self.rank}: {self.seconds * 1e3:.2f} ms ({self.gbps:.2f} GB/s of base weight)")


def time_merge(out_features: int, in_features: int, rank: int, *, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu", repeats: int = 5) -> MergeTiming:
    """The time of :func:`merged_box` on one whole ``out x in`` weight (what the pack step adds per box)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(device=device, dtype=dtype)
    factors = LoraFactors(torch.randn(rank, in_features, generator=generator).to(device=device, dtype=dtype),
                      torch.randn(out_features, rank, generator=generator).to(device=device, dtype=dtype))
    everything = slice(None)
    times = []
    for _ in range(max(1, repeats)):
        if weight.device.type == "cuda":
            torch.cuda.synchronize(weight.device)
        start = time.perf_counter()
        merged_box(weight, factors, 2.0, everything, everything)
        if weight.device.type == "cuda":
            torch.cuda.synchronize(weight.device)
        times.append(time.perf_counter() - start)
    return MergeTiming(out_features, in_features, rank, dtype, sorted(times)[len(times) // 2])


__all__ = ["BoxToMerge", "MergeBatch", "MergeTiming", "lora_delta", "merged_box", "time_merge"]
