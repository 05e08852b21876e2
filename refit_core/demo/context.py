"""What a backend's demo program receives and returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..layout import ParallelLayout


@dataclass
class DemoContext:
    """Arguments of one side's demo program.

    The train side loads ``reference_state_dict(config, seed, step)`` (``refit_core.models``) into its
    model before each step and sends it as weight version ``step``; the gen side receives it and checks
    it against the same reference. ``rendezvous`` is ``host:port``; the train side's rank 0 hosts it.
    """

    model: str
    config: dict[str, Any]
    layout: ParallelLayout
    steps: int
    seed: int
    rendezvous: str
    device: str
    peer_backend: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DemoReport:
    """One side's outcome: ``ok`` only if every check passed; ``lines`` are printed by ``refit demo``."""

    ok: bool
    lines: list[str] = field(default_factory=list)
    bytes_per_step: int = 0
    seconds_per_step: list[float] = field(default_factory=list)
