"""One megatron parameter -> its source pieces: the same code for live parameters and metadata.

Every piece's view is a (strided) view of the local parameter: rows of a fused QKV, half of a
GLU ``fc1``, the real rows of a padded vocabulary, a transposed slice of a legacy ``GroupedMLP``
weight. Nothing is gathered or copied. With ``local=None`` (``refit plan``) views stay None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit_core import Box, PluginError, SourcePiece, TensorSpec

from .families import Kind, Rule


@dataclass(frozen=True)
class Split:
    """How a parameter is split: ``size`` ranks, this is ``rank``, along ``dim`` (None: whole)."""

    size: int = 1
    rank: int = 0
    dim: int | None = None


@dataclass(frozen=True)
class Attention:
    """What fused QKV needs: query heads, query groups and the head dimension."""

    heads: int
    groups: int
    head_dim: int


@dataclass(frozen=True)
class Mamba:
    """What a Mamba mixer's fused parameters need: ``inner`` (heads x head dim), ``groups`` x ``state``
    (the rows of B and of C) and the SSM ``heads``."""

    inner: int
    groups: int
    state: int
    heads: int

    def sections(self, kind: Kind) -> tuple[int, ...]:
        """The global sizes of the fused sections: ``[z, x, B, C, dt]`` (in_proj) or ``[x, B, C]`` (conv1d)."""
        bc = self.groups * self.state
        return (self.inner, self.inner, bc, bc, self.heads) if kind is Kind.MAMBA_IN_PROJ else (self.inner, bc, bc)


@dataclass(frozen=True)
class Param:
    """A megatron parameter on this rank: its name (for errors), local shape, dtype, and memory
    (None from metadata). ``hf`` are the rule's HF names with layer and expert filled in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    hf: tuple[str, ...]
    local: torch.Tensor | None = None


def _view(local: torch.Tensor | None, fn) -> torch.Tensor | None:
    return None if local is None else fn(local)


def _piece(name: str, shape: tuple[int, ...], dtype: torch.dtype, offsets: tuple[int, ...],
           view: torch.Tensor | None, sizes: tuple[int, ...]) -> SourcePiece:
    return SourcePiece(TensorSpec(name, shape, dtype), Box(offsets, sizes), view)


def pieces_of(rule: Rule, param: Param, split: Split, *, attention: Attention | None = None,
              vocab: int | None = None, experts: tuple[int, int] | None = None,
              mamba: Mamba | None = None) -> list[SourcePiece]:
    """The pieces of ``param`` under ``rule``.

    ``attention`` is needed for :attr:`Kind.QKV`, ``vocab`` (the HF vocabulary) for
    :attr:`Kind.VOCAB`, ``experts`` ``(first global expert, total experts)`` for the legacy grouped
    kinds, ``mamba`` for the Mamba mixer's fused kinds.
    """
    kind = rule.kind
    if kind in (Kind.MAMBA_IN_PROJ, Kind.MAMBA_CONV):
        if mamba is None:
            raise PluginError(f"{param.name}: a Mamba mixer parameter needs the mixer's shape")
        return _sections(param, split, mamba, kind)
    if kind is Kind.COPY:
        return [_copy(param, split)]
    if kind is Kind.GLU:
        return _glu(param, split)
    if kind is Kind.QKV:
        if attention is None:
            raise PluginError(f"{param.name}: fused QKV needs the attention shape")
        return _qkv(param, split, attention)
    if kind is Kind.VOCAB:
        if vocab is None:
            raise PluginError(f"{param.name}: a vocabulary parameter needs the HF vocabulary size")
        return _vocab(param, split, vocab)
    if experts is None:
        raise PluginError(f"{param.name}: grouped experts need the global expert index")
    if kind is Kind.GROUPED_GLU:
        return _grouped_glu(param, split, experts)
    return _grouped_down(param, split, experts)


def _copy(param: Param, split: Split) -> SourcePiece:
    shape, offsets = list(param.shape), [0] * len(param.shape)
    if split.dim is not None and split.size > 1:
        offsets[split.dim] = split.rank * shape[split.dim]
        shape[split.dim] *= split.size
    return _piece(param.hf[0], tuple(shape), param.dtype, tuple(offsets), param.local, param.shape)


def _glu(param: Param, split: Split) -> list[SourcePiece]:
    rows, *rest = param.shape
    if rows % 2:
        raise PluginError(f"{param.name}: a GLU fc1 needs an even number of rows, has {rows}")
    half = rows // 2
    out = []
    for index, name in enumerate(param.hf):
        view = _view(param.local, lambda t, i=index: t.narrow(0, i * half, half))
        out.append(_piece(name, (half * split.size, *rest), param.dtype, (split.rank * half, *(0,) * len(rest)),
                          view, (half, *rest)))
    return out


def _qkv(param: Param, split: Split, attn: Attention) -> list[SourcePiece]:
    if attn.heads % attn.groups:
        raise PluginError(f"{param.name}: {attn.heads} heads do not divide into {attn.groups} query groups")
    per_group = attn.heads // attn.groups
    group_rows = (per_group + 2) * attn.head_dim
    total = attn.groups * group_rows
    local_rows, *rest = param.shape
    if local_rows * split.size != total:
        raise PluginError(f"{param.name}: {local_rows} rows x TP {split.size} != {attn.groups} query groups "
                          f"x ({per_group} + 2) heads x {attn.head_dim}")
    start, end = split.rank * local_rows, (split.rank + 1) * local_rows
    segments = ((0, per_group * attn.head_dim, attn.heads), (per_group * attn.head_dim, attn.head_dim, attn.groups),
                ((per_group + 1) * attn.head_dim, attn.head_dim, attn.groups))
    zeros = (0,) * len(rest)
    out = []
    for group in range(attn.groups):
        for name, (offset, rows, hf_heads) in zip(param.hf, segments):
            lo, hi = group * group_rows + offset, group * group_rows + offset + rows
            lo, hi_clip = max(lo, start), min(hi, end)
            if hi_clip <= lo:
                continue
            hf_row = group * rows + lo - (group * group_rows + offset)
            view = _view(param.local, lambda t, a=lo - start, n=hi_clip - lo: t.narrow(0, a, n))
            out.append(_piece(name, (hf_heads * attn.head_dim, *rest), param.dtype, (hf_row, *zeros), view,
                              (hi_clip - lo, *rest)))
    return out


def _sections(param: Param, split: Split, mamba: Mamba, kind: Kind) -> list[SourcePiece]:
    """Sections concatenated on dim 0 and split over TP each on its own: rank r holds
    ``[s0_r; s1_r; ...]`` of the HF tensor ``[s0; s1; ...]``; one piece per section."""
    sizes = mamba.sections(kind)
    rows, *rest = param.shape
    if mamba.heads % split.size or mamba.groups % split.size:
        raise PluginError(f"{param.name}: {mamba.heads} Mamba heads and {mamba.groups} groups must divide over "
                          f"TP {split.size}")
    if rows * split.size != sum(sizes):
        raise PluginError(f"{param.name}: {rows} rows x TP {split.size} != the sections {list(sizes)} "
                          f"({sum(sizes)} rows)")
    zeros = (0,) * len(rest)
    if split.size == 1:  # the whole tensor, one piece
        return [_piece(param.hf[0], (rows, *rest), param.dtype, (0, *zeros), param.local, param.shape)]
    out, local, start = [], 0, 0
    for size in sizes:
        part = size // split.size
        view = _view(param.local, lambda t, a=local, n=part: t.narrow(0, a, n))
        out.append(_piece(param.hf[0], (sum(sizes), *rest), param.dtype, (start + split.rank * part, *zeros), view,
                          (part, *rest)))
        local, start = local + part, start + size
    return out


def _vocab(param: Param, split: Split, vocab: int) -> list[SourcePiece]:
    rows, *rest = param.shape
    if rows * split.size < vocab:
        raise PluginError(f"{param.name}: {rows} rows x TP {split.size} hold fewer than the {vocab} tokens of the "
                          "HF vocabulary")
    start = split.rank * rows
    real = max(0, min(rows, vocab - start))
    if real == 0:
        return []
    view = _view(param.local, lambda t: t.narrow(0, 0, real))
    return [_piece(param.hf[0], (vocab, *rest), param.dtype, (start, *(0,) * len(rest)), view, (real, *rest))]


def _grouped_glu(param: Param, split: Split, experts: tuple[int, int]) -> list[SourcePiece]:
    first, total = experts
    hidden, width = param.shape
    count = _local_experts(param, width, split)
    half = width // count // 2
    out = []
    for index, name in enumerate(param.hf):
        # weight1.view(E_local, hidden, 2f): expert i's [gate_r; up_r] transposed
        view = _view(param.local, lambda t, i=index: t.view(count, hidden, 2 * half)
                     .narrow(2, i * half, half).transpose(1, 2))
        out.append(_piece(name, (total, half * split.size, hidden), param.dtype, (first, split.rank * half, 0),
                          view, (count, half, hidden)))
    return out


def _grouped_down(param: Param, split: Split, experts: tuple[int, int]) -> list[SourcePiece]:
    first, total = experts
    rows, hidden = param.shape
    count = _local_experts(param, rows, split)
    ffn = rows // count
    view = _view(param.local, lambda t: t.view(count, ffn, hidden).transpose(1, 2))
    return [_piece(param.hf[0], (total, hidden, ffn * split.size), param.dtype, (first, 0, split.rank * ffn),
                   view, (count, hidden, ffn))]


def _local_experts(param: Param, width: int, split: Split) -> int:
    count = getattr(param, "experts", None)
    if count is None:
        raise PluginError(f"{param.name}: the number of local experts is unknown")
    if width % count:
        raise PluginError(f"{param.name}: {width} does not divide into {count} local experts")
    return count


@dataclass(frozen=True)
class GroupedParam(Param):
    """A legacy ``GroupedMLP`` weight holding ``experts`` local experts."""

    experts: int = 1
