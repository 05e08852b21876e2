"""Any vLLM ``WeightSource`` as a one-rank refit source: its full tensors, held where refit reads them.

refit reads a training model's shards in place; a ``WeightSource`` it cannot see into (a Megatron
export, a gather onto rank 0, weights from anywhere) is planned from its metadata instead: one
buffer per declared parameter, on train rank 0, refilled from the source's iteration every step and
sent from there. A source that disagrees with its own metadata raises
:class:`~refit_vllm.requests.InvalidRequestError`, a ``ValueError`` as from vLLM's ``nccl`` trainer.
Importing this module does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from refit_core import SourcePiece, TensorSpec

from .requests import InvalidRequestError


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
            raise InvalidRequestError("the WeightSource declares no parameters: refit has nothing to send")
        self.declared = tuple(declared)
        self.buffers = {d.name: torch.empty(d.shape, dtype=d.dtype, device=device) for d in self.declared}
        if len(self.buffers) != len(self.declared):
            raise InvalidRequestError("the WeightSource declares a parameter name twice")

    def pieces(self) -> list[SourcePiece]:
        """Every declared tensor as one whole source piece."""
        out = []
        for d in self.declared:
            spec = TensorSpec(d.name, d.shape, d.dtype)
            out.append(SourcePiece(spec, spec.full_box(), self.buffers[d.name]))
        return out

    def fill(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one pass of the source into the buffers; the pass must yield every declared parameter
        once, in metadata order, with its dtype and shape (else :class:`InvalidRequestError`, a
        ``ValueError`` as vLLM's, naming it)."""
        items = iter(pairs)
        total = len(self.declared)
        for index, want in enumerate(self.declared):
            item = next(items, None)
            if item is None:
                raise InvalidRequestError(f"the WeightSource yielded {index} of the {total} parameters its metadata "
                                          f"declares (first missing: {want.name})")
            name, tensor = item
            if name != want.name:
                raise InvalidRequestError(f"the WeightSource yielded {name!r} where its metadata declares "
                                          f"{want.name!r} (parameter {index}): iteration must follow metadata order")
            if tuple(tensor.shape) != want.shape or tensor.dtype != want.dtype:
                raise InvalidRequestError(f"the WeightSource yielded {name} as {_named(tensor.dtype)} "
                                          f"{list(tensor.shape)}; its metadata declares {_named(want.dtype)} "
                                          f"{list(want.shape)}")
            self.buffers[name].copy_(tensor)
        extra = next(items, None)
        if extra is not None:
            raise InvalidRequestError(f"the WeightSource yielded {extra[0]!r} after the {total} parameters its "
                                      "metadata declares")


def _named(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["Declared", "HeldWeights"]
