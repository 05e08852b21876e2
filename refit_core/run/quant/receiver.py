"""Receiver-side quantization: for tensors whose transfers split quantization blocks.

The gen rank binds a high-precision stand-in (the source's dtype, the piece's shape) where the
executor would write the FP8 piece, lets every byte of the step land, then quantizes each stand-in
into the piece's FP8 view and its scale piece's view. The stand-ins stay allocated between steps
(they cost the high-precision size of those pieces; sender-side quantization needs none).

A failed step tears these pieces only once :meth:`ReceiverQuantizer.finish` has started: the bytes
before it land in the stand-ins, not in engine memory (:meth:`ReceiverQuantizer.torn`). In staged
mode the stand-ins are written by the commit, after every gen rank landed the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refit_core.plan.items import ReceiverQuantization
from refit_core.run.quant.fast import Quantizer, default_quantizer


class ReceiverQuantizer:
    """This gen rank's receiver-side quantizations (from the schedule), bound to its views."""

    def __init__(self, items: Sequence[ReceiverQuantization], quantizer: Quantizer | None = None) -> None:
        self.items = list(items)
        self.quantizer = quantizer or default_quantizer()
        self._bound: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, ReceiverQuantization]] = []
        self._writing = False

    def begin_step(self) -> None:
        """A new step starts: nothing of it has been quantized into engine memory yet."""
        self._writing = False

    def bind(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """``views`` with a fresh high-precision stand-in in place of every receiver-quantized piece."""
        out = list(views)
        self._bound = []
        for item in self.items:
            values = views[item.piece]
            stand_in = torch.empty(tuple(values.shape), dtype=item.dtype, device=values.device)
            out[item.piece] = stand_in
            self._bound.append((stand_in, values, views[item.scale_piece], item))
        return out

    def finish(self) -> None:
        """Quantize every stand-in into its FP8 piece and scale piece (after the step's bytes landed)."""
        self._writing = bool(self._bound)
        for stand_in, values, scales, item in self._bound:
            self.quantizer.quantize_into(stand_in, values, scales, item.quant)

    def torn(self, touched: set[int]) -> set[int]:
        """The bound pieces whose *engine* memory a step wrote, given those it wrote (``touched``):
        a stand-in is not engine memory, but once :meth:`finish` started, every receiver-quantized
        piece's values and scales are."""
        out = touched - {item.piece for item in self.items}
        if self._writing:
            out |= {i for item in self.items for i in (item.piece, item.scale_piece)}
        return out
