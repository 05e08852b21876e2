"""Where one rank's ``setup()`` went: seconds per phase and the metadata it downloaded.

``refit demo`` and ``refit bench`` print it; ``benchmarks/setup_scaling.py`` measures it against the
world size. Phases, in order: the plugin's pieces (and their view checks), the metadata exchange
through the rendezvous store (publish this rank's; the planner, train rank 0, also downloads every
rank's), planning (the planner plans the whole refit and publishes each rank's part; every other
rank waits for, reads and checks its own part: :mod:`refit_core.plan.rankplan`), agreement (a barrier on
the plan's fingerprint), opening the transport, and binding the schedule to the views (a gen rank
binds at its first step, after the plugin's ``refit_begin_update``). Phases that wait for other
ranks (``metadata`` on the planner: until every rank has published; ``plan`` elsewhere: until the
planner has planned; ``agree``; the transport) include that wait: a rank that starts early shows
the late ones' start-up there.
"""

from __future__ import annotations

from dataclasses import dataclass

from refit_core.units import format_bytes


@dataclass(frozen=True)
class SetupTimes:
    """One rank's setup, broken down (seconds); ``metadata_bytes`` is what it read from the store
    (the planner: every rank's metadata; another rank: the options, the sizes and its own part of the
    plan); ``planner`` says whether this rank planned (train rank 0)."""

    pieces_s: float
    metadata_s: float
    plan_s: float
    agree_s: float
    transport_s: float
    bind_s: float | None
    metadata_bytes: int
    planner: bool = False

    @property
    def total_s(self) -> float:
        """All phases (the bind included once it happened)."""
        return (self.pieces_s + self.metadata_s + self.plan_s + self.agree_s + self.transport_s
                + (self.bind_s or 0.0))

    def line(self) -> str:
        """``setup 1.23 s: pieces 0.01, metadata 0.40 (12.3 KiB read), plan 0.30, ...``."""
        bind = "at first step" if self.bind_s is None else f"{self.bind_s:.2f}"
        plan = "plan (planner)" if self.planner else "plan (own part)"
        return (f"setup {self.total_s:.2f} s: pieces {self.pieces_s:.2f}, metadata {self.metadata_s:.2f} "
                f"({format_bytes(self.metadata_bytes)} read), {plan} {self.plan_s:.2f}, agree {self.agree_s:.2f}, "
                f"transport {self.transport_s:.2f}, bind {bind}")

    def to_json(self) -> dict[str, float | int | None]:
        return {"pieces_s": self.pieces_s, "metadata_s": self.metadata_s, "plan_s": self.plan_s,
                "agree_s": self.agree_s, "transport_s": self.transport_s, "bind_s": self.bind_s,
                "metadata_bytes": self.metadata_bytes, "planner": self.planner, "total_s": self.total_s}


__all__ = ["SetupTimes"]
