"""Parallel layouts as the command line writes them: ``fsdp=2,tp=2``."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import RefitError


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism of one side; a missing key means 1.

    ``world_size`` is ``tp * pp * dp * fsdp``: expert parallelism (``ep``, ``etp``) re-partitions
    those same ranks for the MoE layers, as in Megatron-core and vLLM. ``vpp`` splits each pipeline
    stage into virtual chunks.
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    fsdp: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise RefitError(f"layout: {f.name} must be >= 1, got {getattr(self, f.name)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.fsdp

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Parse ``"tp=2,dp=2"`` (empty text: everything 1)."""
        known = {f.name for f in fields(cls)}
        values: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in known:
                raise RefitError(f"layout item {item!r}: expected KEY=N with KEY in {sorted(known)}")
            try:
                values[key] = int(value)
            except ValueError:
                raise RefitError(f"layout item {item!r}: {value!r} is not an integer") from None
        return cls(**values)

    def __str__(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != 1]
        return ",".join(parts) or "single"


def parse_backend_layout(text: str) -> tuple[str, ParallelLayout]:
    """``"dtensor:fsdp=2,tp=2"`` -> ``("dtensor", ParallelLayout(fsdp=2, tp=2))``."""
    backend, _, layout = text.partition(":")
    if not backend:
        raise RefitError(f"{text!r}: expected BACKEND or BACKEND:LAYOUT")
    return backend, ParallelLayout.parse(layout)
