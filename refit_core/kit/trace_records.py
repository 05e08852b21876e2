"""What one traced ``load_weights`` did: the engine tensors, the writes and fills into them, and why not."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refit_core.contract.spec import Box


@dataclass(frozen=True)
class Target:
    """One tensor of an engine module, as it looks in checkpoint format (what loaders write)."""

    module: str
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    load_numel: int
    restored: bool
    """True when the engine re-materializes it around an update (vLLM's reload: most tensors);
    False for tensors that stay live and are written in place (every tensor of a plain swap)."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.module, self.name)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Write:
    """``hf_box`` of HF tensor ``hf_name`` lands in ``target`` at ``dst_box``.

    ``offset`` and ``strides`` give the destination as a strided view shaped like ``hf_box`` (in HF
    dimension order): ``tensor.as_strided(hf_box.sizes, strides, offset)``.
    """

    hf_name: str
    hf_box: Box
    target: tuple[str, str]
    dst_box: Box
    offset: int
    strides: tuple[int, ...]


@dataclass(frozen=True)
class Fill:
    """A constant a loader writes into ``dst_box`` of ``target`` (vocab padding rows)."""

    target: tuple[str, str]
    dst_box: Box
    value: float


@dataclass
class Trace:
    """Everything one traced ``load_weights`` did."""

    targets: dict[tuple[str, str], Target]
    writes: list[Write] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)
    touched: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    """HF name -> targets it wrote (box copies or not)."""
    opaque: dict[tuple[str, str], str] = field(default_factory=dict)
    """Target -> why some write into it is not a plain box copy."""
    rejected: dict[str, str] = field(default_factory=dict)
    """HF name -> the error the model's ``load_weights`` raised for it."""
    cast: dict[str, torch.dtype] = field(default_factory=dict)
    """HF name -> the dtype of the tensor it was copied into, where that differs from its spec."""
    aliases: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    """A module's tensor that is another module's tensor (tied embeddings) -> the owner's key."""
