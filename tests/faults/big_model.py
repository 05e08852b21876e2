"""A model with megabyte messages for the fault tests (the toy model's messages are a few hundred bytes).

``TENSORS`` float32 matrices of ``ROWS x COLS``: train ranks shard every matrix by rows, gen ranks by
columns, so every train rank sends to every gen rank 16 MiB a step: sixteen 1 MiB messages with
:data:`BUCKET_BYTES`, or one 16 MiB message with a bucket that large. Its plugin is registered in
code on a private plugin manager (:func:`plugins`), beside nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

from refit_core import Box, DestinationMap, DestinationPiece, SourcePiece, TensorSpec, hookimpl
from refit_core.contract.plugins import PluginManager
from refit_core.apps import same_bytes

TENSORS, ROWS, COLS = 16, 2048, 512  # 4 MiB a tensor, 64 MiB a step, 16 MiB a pair
BUCKET_BYTES = 1 << 20
SPECS = [TensorSpec(f"big.{i}.weight", (ROWS, COLS), torch.float32) for i in range(TENSORS)]


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    start, end = n * index // parts, n * (index + 1) // parts
    return start, end - start


def reference(step: int) -> dict[str, torch.Tensor]:
    """The full weights of version ``step`` (the same on every process)."""
    out = {}
    for i, spec in enumerate(SPECS):
        generator = torch.Generator().manual_seed(1000 * step + i)
        out[spec.name] = torch.randn(spec.shape, generator=generator)
    return out


class BigTrainer:
    """Train rank ``rank`` of ``world``: rows ``_split(ROWS, world, rank)`` of every matrix."""

    def __init__(self, rank: int, world: int) -> None:
        self.start, rows = _split(ROWS, world, rank)
        self.shards = {spec.name: torch.zeros(rows, COLS) for spec in SPECS}

    def load(self, full: dict[str, torch.Tensor]) -> None:
        for name, shard in self.shards.items():
            shard.copy_(full[name][self.start:self.start + shard.shape[0]])


class BigEngine:
    """Gen rank ``rank`` of ``world``: columns ``_split(COLS, world, rank)`` of every matrix."""

    def __init__(self, rank: int, world: int) -> None:
        self.start, cols = _split(COLS, world, rank)
        self.shards = {spec.name: torch.zeros(ROWS, cols) for spec in SPECS}
        self.version = -1
        self.torn: set[str] = set()

    def serve(self) -> int:
        if self.torn:
            raise RuntimeError(f"big engine: refusing to serve torn weights {sorted(self.torn)}")
        return self.version

    def state(self, old: int, new: int) -> dict[str, str]:
        """Each matrix: "old" (version ``old``'s values), "new" or "mixed"."""
        before, after = reference(old), reference(new)
        out = {}
        for name, shard in self.shards.items():
            cols = slice(self.start, self.start + shard.shape[1])
            out[name] = ("old" if same_bytes(shard, before[name][:, cols]) else
                         "new" if same_bytes(shard, after[name][:, cols]) else "mixed")
        return out


class BigPlugin:
    """The hooks of the two big models."""

    @hookimpl
    def refit_source_pieces(self, model: Any) -> list[SourcePiece] | None:
        if not isinstance(model, BigTrainer):
            return None
        return [SourcePiece(spec, Box((model.start, 0), tuple(model.shards[spec.name].shape)), model.shards[spec.name])
                for spec in SPECS]

    @hookimpl
    def refit_destination_map(self, model: Any) -> DestinationMap | None:
        if not isinstance(model, BigEngine):
            return None
        return DestinationMap([DestinationPiece(spec, Box((0, model.start), tuple(model.shards[spec.name].shape)),
                                                model.shards[spec.name]) for spec in SPECS])

    @hookimpl
    def refit_begin_update(self, model: Any) -> bool | None:
        return False if isinstance(model, BigEngine) else None

    @hookimpl
    def refit_finish_update(self, model: Any, version: int) -> bool | None:
        if not isinstance(model, BigEngine):
            return None
        model.version = version
        model.torn.clear()
        return True

    @hookimpl
    def refit_abort_update(self, model: Any, torn: list[str]) -> bool | None:
        if not isinstance(model, BigEngine):
            return None
        model.torn.update(torn)
        return True


def plugins() -> PluginManager:
    """A plugin manager that knows only the big models."""
    manager = PluginManager(load_entry_points=False)
    manager.register(BigPlugin(), name="big")
    return manager
