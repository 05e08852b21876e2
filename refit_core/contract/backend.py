"""What a plugin registers: a named backend serving the train side, the gen side, or both."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from refit_core.contract.side import Side

TRAIN = Side.TRAIN
GEN = Side.GEN


@dataclass(frozen=True)
class Backend:
    """A backend a plugin provides: its ``name``, the ``sides`` it serves and a one-line ``description``.

    ``sides`` may be given as any iterable of :class:`Side` or their strings (``{"train", "gen"}``); it
    is kept as a ``frozenset[Side]``. What ``refit demo`` runs for a backend is no part of it: see
    :class:`refit_core.kit.DemoPrograms`.
    """

    name: str
    sides: frozenset[Side]
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sides", _sides(self.name, self.sides))


def _sides(name: str, given: Iterable[str]) -> frozenset[Side]:
    """``given`` as Side members; ValueError naming backend ``name`` if empty or not a side."""
    values = frozenset(given)
    known = {side.value for side in Side}
    if not values or not values <= known:
        raise ValueError(f"backend {name!r}: sides must be within {{'train', 'gen'}}")
    return frozenset(Side(value) for value in values)
