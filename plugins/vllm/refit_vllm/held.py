"""Any vLLM ``WeightSource`` as a one-rank refit source: its full tensors, held where refit reads them.

refit reads a training model's shards in place; a ``WeightSource`` it cannot see into (a Megatron
export, a gather onto rank 0, weights from anywhere) is planned from its metadata instead: one
buffer per declared parameter, on train rank 0, refilled from the source's iteration every step and
sent from there. Importing this module does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from refit_core import RefitError, SourcePiece, TensorSpec


@dataclass(frozen=True)
class Declared:
    """One parameter a source declares: HF name, the dtype it yields, full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class HeldWeights:
    """The full tensors of a one-rank source (the refit's only train rank), one buffer per declared
    parameter on ``device``; :meth:`fill` copies a pass of the source into them."""

    def __init__(self, declared: Sequence[Declared], device: torch.device) -> None:
        if not declared:
            raise RefitError("the WeightSource declares no parameters: refit has nothing to send")
        self.declared = tuple(declared)
        self.buffers = {d.name: torch.empty(d.shape, dtype=d.dtype, device=device) for d in self.declared}
        if len(self.buffers) != len(self.declared):
            raise RefitError("the WeightSource declares a parameter name twice")

    def pieces(self) -> list[SourcePiece]:
        """Every declared tensor as one whole source piece."""
        out = []
        for d in self.declared:
            spec = TensorSpec(d.name, d.shape, d.dtype)
            out.append(SourcePiece(spec, spec.full_box(), self.buffers[d.name]))
        return out

    def fill(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one pass of the source into the buffers; the pass must yield every declared parameter
        once, in metadata order, with its dtype and shape (else :class:`RefitError` naming it)."""
        items = iter(pairs)
        for index, want in enumerate(self.declared):
            item = next(items, None)
            if item is None:
                raise RefitError(f"the WeightSource yielded {index} of the {len(self.declared)} parameters its "
                                 f"metadata declares (first missing: {want.name})")
            name, tensor = item
            if name != want.name:
                raise RefitError(f"the WeightSource yielded {name!r} where its metadata declares {want.name!r} "
                                 f"(parameter {index}): iteration must follow metadata order")
            if tuple(tensor.shape) != want.shape or tensor.dtype != want.dtype:
                raise RefitError(f"the WeightSource yielded {name} as {_named(tensor.dtype)} {list(tensor.shape)}; "
                                 f"its metadata declares {_named(want.dtype)} {list(want.shape)}")
            self.buffers[name].copy_(tensor)
        extra = next(items, None)
        if extra is not None:
            raise RefitError(f"the WeightSource yielded {extra[0]!r} after the {len(self.declared)} parameters its "
                             "metadata declares")


def _named(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["Declared", "HeldWeights"]
