"""What a plugin registers: a named backend serving the train side, the gen side, or both."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from refit_core.contract.side import Side

TRAIN = Side.TRAIN
GEN = Side.GEN

LEGACY_DEMO_FIELDS = frozenset({"demo_train", "demo_gen", "demo_train_layout", "demo_gen_layout", "priority",
                                "rl_train_actor", "rl_gen_actor", "demo_quantize"})
"""``refit demo`` settings that ``Backend`` took before they moved to :class:`refit_core.apps.DemoPrograms`."""


@dataclass(frozen=True, init=False)
class Backend:
    """A backend a plugin provides: its ``name``, the ``sides`` it serves and a one-line ``description``.

    ``sides`` may be given as any iterable of :class:`Side` or their strings (``{"train", "gen"}``); it
    is kept as a ``frozenset[Side]``. What ``refit demo`` runs for a backend is no part of it: see
    :class:`refit_core.apps.DemoPrograms`. The demo keywords ``Backend`` took before
    (:data:`LEGACY_DEMO_FIELDS`: ``demo_train=``, ``demo_gen_layout=``, ...) are still accepted until 0.3,
    with a :class:`DeprecationWarning`, and kept as they are in :attr:`legacy_demo` for the kit.
    """

    name: str
    sides: frozenset[Side]
    description: str = ""
    legacy_demo: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)
    """The deprecated demo keywords this backend was built with, by keyword (empty: none)."""

    def __init__(self, name: str, sides: Iterable[str], description: str = "", **legacy_demo: object) -> None:
        unknown = sorted(set(legacy_demo) - LEGACY_DEMO_FIELDS)
        if unknown:
            raise TypeError(f"Backend() got unexpected keyword argument(s): {', '.join(unknown)}")
        if legacy_demo:
            warnings.warn(f"backend {name!r}: Backend({', '.join(sorted(legacy_demo))}=...) is deprecated: register "
                          "refit_core.apps.DemoPrograms through the refit_register_demos hook (the keywords go away "
                          "in refit 0.3)", DeprecationWarning, stacklevel=2)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "sides", _sides(name, sides))
        object.__setattr__(self, "description", description)
        object.__setattr__(self, "legacy_demo", MappingProxyType(dict(legacy_demo)))


def _sides(name: str, given: Iterable[str]) -> frozenset[Side]:
    """``given`` as Side members; ValueError naming backend ``name`` if empty or not a side."""
    values = frozenset(given)
    known = {side.value for side in Side}
    if not values or not values <= known:
        raise ValueError(f"backend {name!r}: sides must be within {{'train', 'gen'}}")
    return frozenset(Side(value) for value in values)
