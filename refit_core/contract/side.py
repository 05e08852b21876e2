"""The two sides of a refit."""

from __future__ import annotations

from enum import StrEnum


class Side(StrEnum):
    """Which side of a refit a rank, a backend or a hook call is on.

    A ``StrEnum``: ``Side.TRAIN == "train"``, so the wire and plugins that still pass strings agree.
    """

    TRAIN = "train"
    """The trainer's ranks: they hold source pieces and send."""
    GEN = "gen"
    """The generation engine's ranks: they hold destination pieces and receive."""

    @property
    def other(self) -> Side:
        """The side across the wire."""
        return Side.GEN if self is Side.TRAIN else Side.TRAIN
