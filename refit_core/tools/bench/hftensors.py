"""HF checkpoint tensors as the baselines see them: where a rank holds each, gathered and scattered."""

from __future__ import annotations

from typing import Any

import torch

from refit_core.contract.experts import default_expert_name
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.models import checkpoint_specs

Parts = list[tuple[Box, torch.Tensor]]


def hf_tensors(model: Any) -> list[tuple[TensorSpec, Parts]]:
    """Every HF checkpoint tensor (per-expert names, checkpoint order) and where this rank holds it.

    Each entry lists ``(box within the HF tensor, local view)``; grouped expert pieces are cut into
    their experts. The baselines assume one rank per side holding whole tensors.
    """
    by_name = model.by_name()
    out = []
    for spec in checkpoint_specs(model.config, grouped=False):
        spec = TensorSpec(spec.name, spec.shape, model.dtype)
        expert = default_expert_name(spec.name)
        parts: Parts = []
        if expert is not None:
            for piece in by_name.get(expert.group, []):
                first, count = piece.box.offsets[0], piece.box.sizes[0]
                if first <= expert.index < first + count:
                    parts.append((Box(piece.box.offsets[1:], piece.box.sizes[1:]), piece.view[expert.index - first]))
        else:
            parts = [(piece.box, piece.view) for piece in by_name.get(spec.name, [])]
        if sum(box.numel for box, _ in parts) != spec.numel:
            raise ValueError(f"the baselines need whole tensors on one rank: {spec.name} is split")
        out.append((spec, parts))
    return out


def materialize(spec: TensorSpec, parts: Parts, device: torch.device) -> torch.Tensor:
    """The HF tensor as one contiguous tensor: the memory itself if it already is one, else a gather."""
    if len(parts) == 1 and parts[0][0].sizes == spec.shape and parts[0][1].is_contiguous():
        return parts[0][1]
    out = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    for box, view in parts:
        box.slice_of(out).copy_(view)
    return out


def scatter(full: torch.Tensor, parts: Parts) -> None:
    """Copy a received HF tensor into the engine's layout (what a ``load_weights`` does)."""
    for box, view in parts:
        view.copy_(box.slice_of(full))


__all__ = ["Parts", "hf_tensors", "materialize", "scatter"]
