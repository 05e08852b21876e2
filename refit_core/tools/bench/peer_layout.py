"""Where the processes of the checkpoint-engine comparison run, and the GPU memory a model shape needs there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refit_core.tools.bench.fit import Fit, fit_layers

GiB = 1 << 30
CE = "checkpoint-engine"
REFIT = "refit"
METHODS = (CE, REFIT)
CE_MAX_BUCKET = 8 * GiB
"""checkpoint-engine's default largest bucket (``PS_MAX_BUCKET_SIZE_GB``); it holds three (H2D buffer
and a double buffer) on each GPU during ``update``."""


class Role:
    """The processes of a run, by rank: 0 trainer, 1 engine; with two GPUs also 2 (checkpoint-engine's
    rank 1, on the engine's GPU) and 3 (the acknowledging worker of its rank 0, on the trainer's GPU)."""

    TRAINER, ENGINE, PS1, ACK0 = 0, 1, 2, 3


@dataclass(frozen=True)
class Layout:
    """Where each rank runs: ``gpus`` 1 (everything on device 0) or 2 (trainer side on 0, engine side on 1)."""

    gpus: int

    @property
    def nprocs(self) -> int:
        return 2 if self.gpus == 1 else 4

    @property
    def bound(self) -> str:
        return "copy-bound" if self.gpus == 1 else "wire"

    def device_index(self, rank: int) -> int:
        return 0 if self.gpus == 1 or rank in (Role.TRAINER, Role.ACK0) else 1

    def ps_rank(self, rank: int) -> int | None:
        """checkpoint-engine's rank of the ``ParameterServer`` this process runs (None: none)."""
        return {Role.TRAINER: 0, Role.PS1: 1}.get(rank) if self.gpus == 2 or rank == Role.TRAINER else None

    def worker_of(self, rank: int) -> int | None:
        """The ``ParameterServer`` rank whose IPC worker this process is (None: not a worker)."""
        if self.gpus == 1:
            return 0 if rank == Role.ENGINE else None
        return {Role.ENGINE: 1, Role.ACK0: 0}.get(rank)


def needed_bytes(model_bytes: int, layout: Layout, bound_bytes: int) -> int:
    """GPU memory of the fullest device: a model (twice on one GPU, with 10% working memory), the bound's
    buffers (two copy-bound chunks; the wire's buffer of the model's size) and checkpoint-engine's three
    buckets."""
    ce = 3 * min(CE_MAX_BUCKET, model_bytes) + 2 * GiB
    if layout.gpus == 1:
        return int(2.2 * model_bytes) + 2 * min(model_bytes, bound_bytes) + ce
    return int(2.2 * model_bytes) + ce


def fit_model(name: str, config: dict[str, Any], budget: int | None, layout: Layout, bound_bytes: int) -> Fit:
    """How ``name`` runs on ``layout`` within ``budget`` bytes on its fullest GPU (None: whole)."""
    return fit_layers(name, config, budget, lambda n: needed_bytes(n, layout, bound_bytes))


__all__ = ["CE", "CE_MAX_BUCKET", "METHODS", "REFIT", "Layout", "Role", "fit_model", "needed_bytes"]
