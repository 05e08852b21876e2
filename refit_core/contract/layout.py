"""Parallel layouts as the command line writes them: ``fsdp=2,tp=2``."""

from __future__ import annotations

from dataclasses import dataclass, fields

from refit_core.contract.errors import RefitError


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism of one side; a missing key means 1.

    ``world_size`` is ``tp * pp * dp * fsdp``: expert parallelism (``ep``, ``etp``) re-partitions
    those same ranks for the MoE layers, as in Megatron-core and vLLM. ``vpp`` splits each pipeline
    stage into virtual chunks. ``pp_first`` / ``pp_last`` are the transformer layers of the first /
    last pipeline stage where they differ from the rest (Megatron's uneven pipeline,
    ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``); 0 (the default)
    means that stage takes an even share.
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    fsdp: int = 1
    pp_first: int = 0
    pp_last: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            least = 0 if f.name in _STAGE_SIZES else 1
            if getattr(self, f.name) < least:
                raise RefitError(f"layout: {f.name} must be >= {least}, got {getattr(self, f.name)}")
        if self.uneven and self.pp < 2:
            raise RefitError(f"layout: pp_first / pp_last need pp >= 2, got pp={self.pp}")

    def given(self) -> dict[str, int]:
        """The keys set to something other than their default (1, or 0 for ``pp_first`` / ``pp_last``):
        what a plugin that takes only some keys checks (``layout.given().keys() - {"dp", "fsdp"}``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    @property
    def uneven(self) -> bool:
        """Whether the first or last pipeline stage has its own layer count."""
        return bool(self.pp_first or self.pp_last)

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
        return ",".join(f"{k}={v}" for k, v in self.given().items()) or "single"


_STAGE_SIZES = ("pp_first", "pp_last")


def parse_backend_layout(text: str) -> tuple[str, ParallelLayout]:
    """``"dtensor:fsdp=2,tp=2"`` -> ``("dtensor", ParallelLayout(fsdp=2, tp=2))``."""
    backend, _, layout = text.partition(":")
    if not backend:
        raise RefitError(f"{text!r}: expected BACKEND or BACKEND:LAYOUT")
    return backend, ParallelLayout.parse(layout)
