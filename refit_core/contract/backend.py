"""What a plugin registers: a named backend serving the train side, the gen side, or both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from refit_core.contract.side import Side

if TYPE_CHECKING:
    from refit_core.kit.demo import DemoContext, DemoReport

TRAIN = Side.TRAIN
GEN = Side.GEN

DemoProgram = Callable[["DemoContext"], "DemoReport"]


@dataclass(frozen=True)
class Backend:
    """A backend a plugin provides.

    ``demo_train`` / ``demo_gen`` are the programs ``refit demo`` runs for this backend on each
    side: each receives a :class:`~refit_core.kit.demo.DemoContext` and returns a report.
    ``demo_train_layout`` / ``demo_gen_layout`` are the layouts ``refit demo`` uses by default
    (``"fsdp=2"``); ``priority`` orders backends when ``refit demo`` picks the best installed pair.
    ``rl_train_actor`` / ``rl_gen_actor`` are ``"module:Class"`` import paths of the Ray actor classes
    ``refit demo --loop`` uses (:mod:`refit_core.tools.demo.rl_loop` states their methods); empty: none.
    ``demo_quantize`` lists the quantized destinations its gen demo can hold (``"fp8"``: block-FP8
    linear weights, for ``refit demo --quantize fp8``).
    """

    name: str
    sides: frozenset[str]
    description: str = ""
    demo_train: DemoProgram | None = field(default=None, compare=False)
    demo_gen: DemoProgram | None = field(default=None, compare=False)
    demo_train_layout: str = ""
    demo_gen_layout: str = ""
    priority: int = 0
    rl_train_actor: str = ""
    rl_gen_actor: str = ""
    demo_quantize: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sides", frozenset(self.sides))
        object.__setattr__(self, "demo_quantize", frozenset(self.demo_quantize))
        unknown = self.sides - {TRAIN, GEN}
        if unknown or not self.sides:
            raise ValueError(f"backend {self.name!r}: sides must be within {{'train', 'gen'}}")
