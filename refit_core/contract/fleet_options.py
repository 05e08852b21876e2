"""A fleet's settings (:class:`FleetOptions`, ``RefitOptions.fleet``): how train rank 0 feeds the replicas and
judges a step that loses one."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from refit_core.contract.errors import OptionError
from refit_core.contract.settings import _setting, _Settings, _tracks_explicit


class Membership(StrEnum):
    """How a fleet's step treats a replica lost mid-step (:class:`FleetOptions`)."""

    PER_REPLICA = "per_replica"
    """The lost replica, and the replicas below it in the relay tree, fail the step; the others commit it and the
    run goes on (``RefitFleet.send()`` reports the failures)."""
    STRICT = "strict"
    """Any lost replica fails the fleet's step: ``RefitFleet.send()`` raises on every train rank (a
    ``FleetStepError`` saying which replicas hold the version), as a fixed world's step does."""


@_tracks_explicit
@dataclass(frozen=True)
class FleetOptions(_Settings):
    """How a fleet (:class:`~refit_core.RefitFleet`) feeds its replicas and judges its steps (train rank 0's own
    setting: only its values count).

    - ``membership``: :class:`Membership` (``per_replica`` by default).
    - ``direct``: how many replicas the trainers feed themselves (0, the default: all of them). Past that, a
      joining replica is fed by a replica of its layout that already holds the weights (its *feeder*), which
      forwards each step once it landed it: the relay tree of the fleet. Engines with a loader path or
      quantized destinations are always fed by the trainers.
    - ``fanout``: replicas each feeder forwards to (2).
    """

    membership: Membership = _setting(Membership.PER_REPLICA, Membership)
    direct: int = _setting(0, int)
    fanout: int = _setting(2, int)

    def __post_init__(self) -> None:
        self._coerce()
        if self.direct < 0 or self.fanout < 1:
            raise OptionError(f"FleetOptions(direct={self.direct}, fanout={self.fanout}): direct must be >= 0 and "
                              "fanout >= 1")


__all__ = ["FleetOptions", "Membership"]
