"""Shapes that fit the card: a model too large for the device's memory runs as a slice of its layers.

A slice keeps every per-layer shape and the embeddings and drops layers from the end; it is named
in the output (``NAME[24/48 layers]``). A shape of which not even one layer fits is skipped with a
one-line reason. Pure arithmetic on the config's checkpoint specs: no device is touched (only
:func:`memory_budget` reads the GPU's size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refit_core.kit.models import checkpoint_specs

GiB = 1 << 30
MEMORY_RESERVE = 3 * GiB
"""GPU memory kept out of the budget: two processes' CUDA contexts and the allocator's slack."""


@dataclass(frozen=True)
class Fit:
    """How a model runs: ``layers`` of ``total_layers`` (all of them: no slice), or skipped (``layers``
    0, ``reason`` why)."""

    name: str
    layers: int
    total_layers: int
    reason: str | None = None

    @property
    def skipped(self) -> bool:
        return self.layers == 0

    @property
    def sliced(self) -> bool:
        return 0 < self.layers < self.total_layers

    @property
    def label(self) -> str:
        """The model's name in the output: ``NAME[K/N layers]`` for a slice."""
        return f"{self.name}[{self.layers}/{self.total_layers} layers]" if self.sliced else self.name

    def config(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with this fit's layers."""
        return dict(config, num_hidden_layers=self.layers) if self.sliced else config


def model_bytes(config: dict[str, Any], layers: int | None = None) -> int:
    """The checkpoint's bytes (with ``layers`` layers if given)."""
    if layers is not None:
        config = dict(config, num_hidden_layers=layers)
    return sum(spec.nbytes for spec in checkpoint_specs(config))


def fit_layers(name: str, config: dict[str, Any], budget_bytes: int | None,
               needed: Callable[[int], int]) -> Fit:
    """The most layers of ``config`` whose ``needed(model bytes)`` fits ``budget_bytes`` (None: no limit)."""
    total = int(config["num_hidden_layers"])
    if budget_bytes is None:
        return Fit(name, total, total)
    fixed = model_bytes(config, 0)
    per_layer = (model_bytes(config, total) - fixed) / total
    for layers in range(total, 0, -1):  # per_layer is exact (the same shapes each layer); count down safely
        if needed(int(fixed + per_layer * layers)) <= budget_bytes:
            return Fit(name, layers, total)
    return Fit(name, 0, total, f"skipped {name}: even one layer needs {needed(int(fixed + per_layer)) / GiB:.1f} "
                               f"GiB, the device has {budget_bytes / GiB:.1f} GiB")


def memory_budget(device: torch.device, memory_gib: float | None) -> int | None:
    """The bytes a run may use: ``memory_gib`` if given, else the GPU's memory less the reserve (None on CPU)."""
    if memory_gib is not None:
        return int(memory_gib * GiB)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory - MEMORY_RESERVE
