"""The sending direction: pack each round's staged messages (casting, quantizing, merging LoRA), then send."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from refit_core.contract.errors import TransferError
from refit_core.contract.lora import LoraFactors, LoraMerge
from refit_core.net.transport import Fence, Transport
from refit_core.plan.items import Message, Segment
from refit_core.run.executor.base import ExecutorSettings, RoundRunner, StepCount, StepStats
from refit_core.run.executor.headers import HeaderScope
from refit_core.run.executor.rounds import RoundPlan, pack
from refit_core.run.merge import BoxToMerge, Deltas, MergeBatch
from refit_core.run.quant.batched import quantize_batch
from refit_core.run.quant.boxes import BoxToQuantize
from refit_core.run.quant.fast import Quantizer, default_quantizer
from refit_core.run.timing import Phase, Timeline


@dataclass(frozen=True)
class Merging:
    """Merged-mode LoRA on a train rank: per bound piece, the adapter folded into it when packed (None:
    sent as it is), and its box's offsets in its whole tensor (where merged boxes sit in the base weight)."""

    merges: Sequence[LoraMerge | None] = ()
    origins: Sequence[tuple[int, ...]] = ()

    def of(self, piece: int) -> LoraMerge | None:
        """The adapter merged into piece ``piece`` (None: none)."""
        return self.merges[piece] if piece < len(self.merges) else None


class SendExecutor(RoundRunner):
    """Runs a train rank's rounds: pack (staged messages only; quantizing where the plan says), send."""

    gaps_allowed = True
    packs = True

    def __init__(self, rounds: list[list[Message]], transport: Transport, peer_offset: int,
                 settings: ExecutorSettings, *, scope: HeaderScope = HeaderScope(), steps: StepCount | None = None,
                 merging: Merging = Merging(), quantizer: Quantizer | None = None) -> None:
        super().__init__(rounds, transport, peer_offset, settings, scope=scope, steps=steps)
        self.merging = merging
        self.quantizer = default_quantizer() if quantizer is None else quantizer
        self.deltas: Deltas | None = None
        """The merged boxes' deltas, per step (None: nothing merged)."""

    def _peer(self, m: Message) -> int:
        return m.dst

    def _segments(self, m: Message) -> tuple[Segment, ...]:
        return m.src_segments

    def _as_is(self, piece: int) -> bool:
        return self.merging.of(piece) is None

    def bind(self, views: list[torch.Tensor]) -> None:
        super().bind(views)
        for plan in self.plans:
            plan.quantization = quantize_batch(
                [BoxToQuantize(view, seg.quant, seg.offset, seg.scales_offset)
                 for seg, view, planned in zip(plan.segments, plan.views, plan.planned)
                 if seg.quant is not None and self._as_is(planned.piece)], self.quantizer)
            plan.merges = self._merge_batch(plan)
        merged = [box for plan in self.plans if plan.merges is not None for box in plan.merges.boxes]
        self.deltas = Deltas(merged) if merged else None
        self._warm_up_quantizer()

    def _merge_batch(self, plan: RoundPlan) -> MergeBatch | None:
        """The round's merged segments (each a box of a base weight; its rows and columns in the whole weight)."""
        merged = []
        origins = self.merging.origins
        for staged, view, seg in zip(plan.segments, plan.views, plan.planned):
            piece = seg.piece
            merge = self.merging.of(piece)
            if merge is None:
                continue
            if staged.quant is not None:
                raise TransferError(f"{merge.module}: merged LoRA cannot be quantized in the same pack step "
                                    "(send merged weights unquantized, or adapters in adapter mode)")
            if len(seg.box.sizes) != 2 or piece >= len(origins):
                raise TransferError(f"refit bug: merged piece {piece} ({merge.module}) is not a bound 2-D box")
            row, col = (o + s for o, s in zip(origins[piece], seg.box.offsets))
            rows, cols = seg.box.sizes
            merged.append(BoxToMerge(view, merge, slice(row, row + rows), slice(col, col + cols), staged.dtype,
                                     staged.sizes, staged.strides, staged.offset))
        return MergeBatch(merged) if merged else None

    def _warm_up_quantizer(self) -> None:
        """Compile the quantizer's kernels at setup, not inside the first step (where peers would wait)."""
        warmed: set[object] = set()
        for plan in self.plans:
            if plan.quantization is not None:
                plan.quantization.warm_up(warmed)

    def run(self, version: int, *, factors: Mapping[str, LoraFactors] | None = None,
            timeline: Timeline | None = None) -> StepStats:
        """Send one step as weight ``version``. ``factors``: the adapters gathered for this step (merged mode;
        None: nothing merged); ``timeline``: records the step's spans (None: not recorded), read back as
        :attr:`last_timeline`."""
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        self._begin(timeline)
        headers, ready = self._post_headers(version, "the trainer's pending work")
        buffers = self._buffers()
        self._check_headers(headers, version, deadline)
        if self.deltas is not None:
            self.deltas.begin(factors)
        free: list[Fence | None] = [None] * len(buffers)
        pending: list[Fence] = []
        staged = 0
        for index, plan in enumerate(self.plans):
            after: list[Fence] = []
            buffer = None
            if plan.staged_bytes:
                slot = staged % len(buffers)
                staged += 1
                buffer = buffers[slot]
                self._settle(free[slot], deadline)
                after.append(self.lane.run(partial(pack, buffer, plan, self.deltas),
                                           after=[ready, free[slot]], mark=self._mark(Phase.PACK, index)))
            fence = self._exchange(plan.pairs(buffer), [], after or [ready], index)
            pending.append(fence)
            if plan.staged_bytes:
                free[slot] = fence
        self.headers.prepare_next(version, self.step)
        self._finish(pending, deadline)
        if self.deltas is not None:
            self.deltas.end()
        self._end()
        stats = self._stats(version, start, buffers)
        del buffers, free, pending
        return stats


__all__ = ["Merging", "SendExecutor"]
