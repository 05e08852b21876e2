"""Source and destination pieces: a box of a logical tensor and the local memory that holds it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refit_core.contract.records import unchecked
from refit_core.contract.spec import Box, TensorSpec


@dataclass(frozen=True)
class PieceMeta:
    """What the planner knows of a piece: which logical tensor, and which box of it."""

    spec: TensorSpec
    box: Box


@dataclass
class Piece:
    """A box of a logical tensor held by this rank.

    ``view`` is the local tensor whose elements are exactly the box, shaped ``box.sizes``; it may be
    any strided view of a parameter (a slice of a fused QKV, a column block, ...). It is None when
    the piece comes from metadata alone (``refit plan``).
    """

    spec: TensorSpec
    box: Box
    view: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.box.within(self.spec.shape):
            raise ValueError(f"{self.spec.name}: box {self.box} lies outside shape {self.spec.shape}")
        if self.view is not None and tuple(self.view.shape) != self.box.sizes:
            raise ValueError(
                f"{self.spec.name}: view shape {tuple(self.view.shape)} != box sizes {self.box.sizes}"
            )
        if self.view is not None and self.view.dtype != self.spec.dtype:
            raise ValueError(f"{self.spec.name}: view dtype {self.view.dtype} != spec dtype {self.spec.dtype}")

    @classmethod
    def of(cls, spec: TensorSpec, box: Box) -> Piece:
        """A metadata-only piece (view None) whose box is known to lie in ``spec``'s shape (checked on
        a piece of the same shape already), without re-checking it: layout hooks describe every rank of
        a large layout, the same boxes over and over."""
        return unchecked(cls)(spec, box)

    @property
    def meta(self) -> PieceMeta:
        return _meta(self.spec, self.box)  # fields known good: skip the frozen dataclass' per-field setattr


_meta = unchecked(PieceMeta)


class SourcePiece(Piece):
    """A box a training rank holds; its ``view`` is read (and cast) at every step."""


class DestinationPiece(Piece):
    """A box a generation rank must receive; its ``view`` is written in place at every step."""


@dataclass
class DestinationMap:
    """Everything a generation rank receives.

    ``pieces`` land directly in engine memory (the fast path). ``loader`` lists whole logical
    tensors that are received into fresh buffers and handed to the engine's own loader
    (``refit_load_weights``), for what the fast path cannot write directly (layouts the plugin
    does not know, engines that repack on load). Quantized (FP8) tensors may be on either path: their
    specs carry a :class:`~refit_core.contract.spec.Quantization`. A plugin must put complete fused groups on
    the loader path (q, k and v together).
    """

    pieces: list[DestinationPiece]
    loader: list[TensorSpec] = field(default_factory=list)
