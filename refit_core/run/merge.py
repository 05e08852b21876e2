"""Merged-mode LoRA in the pack step: ``W + scale * B @ A`` for each box a sender stages, never a merged model.

PEFT's ``merge_and_unload()`` (``LoraLayer.merge`` with ``get_delta_weight``, peft 0.21) computes, per
adapted ``nn.Linear``::

    delta = (B @ A) * scaling            # in B's dtype; on CPU, bf16/fp16 factors are upcast to fp32
    delta = delta.to(B.dtype)            # (only after that upcast)
    W += delta                           # in place: computed in the promoted dtype, stored in W's

:func:`lora_delta` and :func:`merged_box` repeat exactly that; a box takes its rows and columns of both.
The delta is computed for the whole weight, as PEFT does (:class:`Deltas`: once per module per step,
freed after the module's last box), so every box is bitwise PEFT's on the same device and library;
only the add touches the box.
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
    half-precision factors, as PEFT does), for the whole weight."""
    upcast = b.device.type == "cpu" and b.dtype in _HALF
    if upcast:
        delta = (b.float() @ a.float()) * scale
        return delta.to(b.dtype)
    return (b @ a) * scale


def merged_box(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``weight`` (a box of the base weight) plus ``delta`` (the same box of :func:`lora_delta`), in
    ``weight``'s dtype: what ``merge_and_unload()``'s ``W += delta`` leaves there."""
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


class Deltas:
    """The step's adapter deltas: each module's whole ``scale * B @ A``, computed when its first box is
    packed and dropped after its last, so that at most the modules being packed hold one.

    Whole, not per box: a GEMM's rounding may depend on its shape (a narrow column block of ``B @ A``
    can differ in the last bit from the same block of the whole product on CPU), and PEFT multiplies
    the whole matrices."""

    def __init__(self, boxes: Sequence[BoxToMerge]) -> None:
        self.uses: dict[str, int] = {}
        for box in boxes:
            self.uses[box.merge.module] = self.uses.get(box.merge.module, 0) + 1
        self.factors: Mapping[str, LoraFactors] | None = None
        self.live: dict[str, torch.Tensor] = {}
        self.left: dict[str, int] = {}

    def begin(self, factors: Mapping[str, LoraFactors] | None) -> None:
        """A step starts with its gathered adapters."""
        self.factors, self.live, self.left = factors, {}, dict(self.uses)

    def end(self) -> None:
        self.factors, self.live = None, {}

    def of(self, box: BoxToMerge) -> torch.Tensor:
        """The delta over ``box``."""
        module = box.merge.module
        delta = self.live.get(module)
        if delta is None:
            if self.factors is None:
                raise TransferError("refit bug: a merged-mode step packs before its adapters were gathered")
            factors = self.factors.get(module)
            if factors is None:
                raise TransferError(f"merged mode: no adapter was gathered for {module}")
            delta = self.live[module] = lora_delta(factors.a, factors.b, box.merge.scale)
        self.left[module] -= 1
        if not self.left[module]:
            del self.live[module]
        return delta[box.rows, box.cols]


class MergeBatch:
    """Merges a fixed list of boxes into a staging buffer, from the step's :class:`Deltas`."""

    def __init__(self, boxes: Sequence[BoxToMerge]) -> None:
        self.boxes = list(boxes)

    def run(self, buffer: torch.Tensor, deltas: Deltas | None) -> None:
        if deltas is None:
            raise TransferError("refit bug: a merged-mode round packs without the step's deltas")
        typed: dict[torch.dtype, torch.Tensor] = {}
        for box in self.boxes:
            flat = typed.get(box.dtype)
            if flat is None:
                flat = typed[box.dtype] = buffer.view(box.dtype)
            staged = flat.as_strided(box.sizes, box.strides, box.offset // dtype_size(box.dtype))
            staged.copy_(merged_box(box.source, deltas.of(box)))


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
    """The time of merging one whole ``out x in`` weight (:func:`lora_delta` and :func:`merged_box`: what
    the pack step adds per adapted weight)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(device=device, dtype=dtype)
    factors = LoraFactors(torch.randn(rank, in_features, generator=generator).to(device=device, dtype=dtype),
                      torch.randn(out_features, rank, generator=generator).to(device=device, dtype=dtype))
    times = []
    for _ in range(max(1, repeats)):
        if weight.device.type == "cuda":
            torch.cuda.synchronize(weight.device)
        start = time.perf_counter()
        merged_box(weight, lora_delta(factors.a, factors.b, 2.0))
        if weight.device.type == "cuda":
            torch.cuda.synchronize(weight.device)
        times.append(time.perf_counter() - start)
    return MergeTiming(out_features, in_features, rank, dtype, sorted(times)[len(times) // 2])


__all__ = ["BoxToMerge", "Deltas", "MergeBatch", "MergeTiming", "lora_delta", "merged_box", "time_merge"]
