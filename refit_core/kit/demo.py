"""``refit demo`` for plugin authors: what a backend registers (programs), and what a program receives and returns.

A plugin offers demo programs for its backends by implementing
:meth:`DemoHookspecs.refit_register_demos` and registering one :class:`DemoPrograms` per
backend. A program receives a :class:`DemoContext` and returns a :class:`DemoReport`; a train program's
ranks can run the whole send loop with :func:`send_versions` and :func:`train_demo`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from refit_core.contract.backend import Backend
from refit_core.contract.hookspecs import hookspec
from refit_core.contract.layout import ParallelLayout
from refit_core.contract.options import Colocation, RefitOptions
from refit_core.contract.side import Side
from refit_core.contract.spec import TensorSpec
from refit_core.endpoints.sender import RefitSender
from refit_core.kit.launch import spawn
from refit_core.units import format_bytes

if TYPE_CHECKING:
    import torch

    from refit_core.contract.plugins import PluginManager
    from refit_core.plan.schedule import Schedule
    from refit_core.run.timing import SetupTimes


class Phase(Enum):
    """The phases ``refit demo`` shows, one console line each."""

    BUILD = "build"
    SETUP = "setup"
    STEP = "step"
    VERIFY = "verify"


@dataclass(frozen=True)
class ProgressEvent:
    """One console line of ``refit demo``: which side reported it, in which phase."""

    side: str
    phase: Phase
    text: str
    step: int | None = None

    @property
    def label(self) -> str:
        return self.phase.value if self.step is None else f"{self.phase.value} {self.step}"

    def to_json(self) -> str:
        return json.dumps({"side": self.side, "phase": self.phase.value, "text": self.text, "step": self.step})

    @classmethod
    def from_json(cls, line: str) -> ProgressEvent:
        data = json.loads(line)
        step = data.get("step")
        return cls(str(data["side"]), Phase(data["phase"]), str(data["text"]), None if step is None else int(step))


@dataclass(frozen=True)
class ProgressLog:
    """Where a demo program reports its phases: one JSON line per event appended to ``path``.

    Any rank process of the side may report (appends of one short line are atomic); with ``path``
    None events are printed instead (a demo program run by hand).
    """

    side: str
    path: str | None = None

    def report(self, phase: Phase, text: str, step: int | None = None) -> None:
        event = ProgressEvent(self.side, phase, text, step)
        if self.path is None:
            print(f"{event.label:<7} {self.side}: {text}", flush=True)
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (event.to_json() + "\n").encode())
        finally:
            os.close(fd)

    def built(self, what: str, seconds: float) -> None:
        self.report(Phase.BUILD, f"{what} ({seconds:.1f} s)")

    def planned(self, schedule: Schedule, seconds: float, times: SetupTimes | None = None) -> None:
        """The setup line: the agreed plan's size, messages and fingerprint; with ``times`` (the
        endpoint's :attr:`~refit_core.endpoints.sender.RefitSender.setup_times`) a second line breaks setup down."""
        summary = schedule.summary
        self.report(Phase.SETUP, f"plan {format_bytes(summary.bytes)} in {summary.segments} segments, "
                                 f"{summary.messages} messages in {summary.rounds} rounds, "
                                 f"fingerprint {schedule.fingerprint[:12]} ({seconds:.1f} s)")
        if times is not None:
            self.report(Phase.SETUP, times.line())

    def step(self, step: int, nbytes: int, seconds: float, verdict: str = "") -> None:
        """One step's line: bytes moved, time, throughput and (optionally) its check."""
        rate = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        self.report(Phase.STEP, f"{format_bytes(nbytes)} in {1000 * seconds:.1f} ms ({rate:.3f} GB/s)"
                                + (f", {verdict}" if verdict else ""), step)


@dataclass
class DemoContext:
    """Arguments of one side's demo program.

    The train side loads :meth:`reference` of each step into its model and sends it as weight
    version ``step``; the gen side receives it and checks it against the same reference.
    ``specs`` is the model's checkpoint inventory (``refit_core.kit.models.model_inventory``), so the
    reference weights follow the model's own tensors. ``rendezvous`` is ``host:port``; the train
    side's rank 0 hosts it. ``progress`` takes the phase lines ``refit demo`` prints.
    ``quantize`` is ``"fp8"`` when the gen side must hold block-FP8 linear weights (checked against
    :func:`refit_core.kit.verify.quantized_reference`), None for plain weights.
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
    specs: tuple[TensorSpec, ...] = ()
    progress: ProgressLog = field(default_factory=lambda: ProgressLog("?"))
    quantize: str | None = None

    def reference(self, step: int) -> dict[str, torch.Tensor]:
        """The HF state dict (checkpoint names) of weight version ``step``."""
        from refit_core.kit.models import reference_state_dict

        return reference_state_dict(list(self.specs) if self.specs else self.config, self.seed, step)

    @property
    def colocated(self) -> bool:
        """``refit demo --colocate``: the gen side runs on the trainer's devices (its GPUs, or its host's
        shared memory), not beside them."""
        return self.options.get("colocate") == Colocation.SHARED.value


@dataclass
class DemoReport:
    """One side's outcome: ``ok`` only if every check passed.

    ``lines``: the side's verification verdict and any problems (printed by ``refit demo``).
    """

    ok: bool
    lines: list[str] = field(default_factory=list)
    bytes_per_step: int = 0
    seconds_per_step: list[float] = field(default_factory=list)


DemoProgram = Callable[[DemoContext], DemoReport]
"""One side's demo program: runs that side's ranks for ``refit demo`` and reports how it went."""


@dataclass(frozen=True)
class DemoPrograms:
    """What ``refit demo`` runs for one ``backend`` (named as in ``refit_register_backends``).

    ``train`` / ``gen``: the program for each side the backend serves (None: no demo on that side).
    ``train_layout`` / ``gen_layout``: the layouts ``refit demo`` uses by default (``"fsdp=2"``; empty:
    one rank). ``priority``: the highest wins when ``refit demo`` picks the best installed pair.
    ``rl_train_actor`` / ``rl_gen_actor``: ``"module:Class"`` import paths of the Ray actor classes
    ``refit demo --loop`` uses (:mod:`refit_core.tools.demo.rl_loop` states their methods); empty: none.
    ``quantize``: the quantized destinations the gen program can hold (``"fp8"``: block-FP8 linear
    weights, for ``refit demo --quantize fp8``).
    """

    backend: str
    train: DemoProgram | None = field(default=None, compare=False)
    gen: DemoProgram | None = field(default=None, compare=False)
    train_layout: str = ""
    gen_layout: str = ""
    priority: int = 0
    rl_train_actor: str = ""
    rl_gen_actor: str = ""
    quantize: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantize", frozenset(self.quantize))

    def program(self, side: Side) -> DemoProgram | None:
        """The program of ``side``; None if the backend offers none there."""
        return self.train if side == Side.TRAIN else self.gen

    def layout(self, side: Side) -> str:
        """The default layout of ``side``'s program (empty: one rank)."""
        return self.train_layout if side == Side.TRAIN else self.gen_layout

    def rl_actor(self, side: Side) -> str:
        """The ``"module:Class"`` path of ``side``'s Ray actor for ``refit demo --loop``; empty: none."""
        return self.rl_train_actor if side == Side.TRAIN else self.rl_gen_actor


class DemoHookspecs:
    """The hook a plugin implements to offer ``refit demo`` programs: declared by the kit, not the contract.

    The contract's plugin manager knows nothing of demos; :func:`installed_demos` adds this hook to it when
    ``refit demo`` (or the conformance kit) needs it. Plugins implement it with ``refit_core.hookimpl``
    like every other hook.
    """

    @hookspec
    def refit_register_demos(self, register: Callable[[DemoPrograms], None]) -> None:
        """Register what ``refit demo`` runs for your backends by calling ``register(DemoPrograms(...))``.

        One :class:`DemoPrograms` per backend (named as in ``refit_register_backends``): its train and gen
        programs, default layouts, priority, Ray actors and quantized destinations.
        """


REGISTER_DEMOS = DemoHookspecs.refit_register_demos.__name__


@dataclass(frozen=True)
class DemoCatalog:
    """The demo programs the installed plugins registered, by backend name."""

    programs: Mapping[str, DemoPrograms]

    def of(self, backend: str) -> DemoPrograms:
        """What ``backend`` registered; a record without programs if it registered none."""
        return self.programs.get(backend, DemoPrograms(backend))


def installed_demos(pm: PluginManager) -> DemoCatalog:
    """The demo programs ``pm``'s plugins register through ``refit_register_demos`` (the hook is added to
    ``pm`` here). A backend registered twice keeps its last registration."""
    pm.add_hookspecs(DemoHookspecs)
    registered: Iterable[DemoPrograms] = (item for items in pm.registrations(REGISTER_DEMOS).values()
                                          for item in items)
    legacy = {backend.name: _from_legacy(backend) for backend in pm.backends() if backend.legacy_demo}
    return DemoCatalog(legacy | {programs.backend: programs for programs in registered})


_LEGACY_NAMES = {"demo_train": "train", "demo_gen": "gen", "demo_train_layout": "train_layout",
                 "demo_gen_layout": "gen_layout", "demo_quantize": "quantize"}


def _from_legacy(backend: Backend) -> DemoPrograms:
    """The programs a backend gave ``Backend`` itself, as plugins did before :class:`DemoPrograms`."""
    fields = {_LEGACY_NAMES.get(key, key): value for key, value in backend.legacy_demo.items()}
    return DemoPrograms(backend.name, **fields)  # type: ignore[arg-type]


def send_versions(ctx: DemoContext, model: Any, rank: int, world: int, load: Callable[[int], None]) -> list[float]:
    """One train rank's demo loop: set up a sender for ``model``, then for each of ``ctx.steps`` steps
    ``load(step)`` (put weight version ``step`` into the model, in place) and send it.

    Rank 0 reports the setup line to ``ctx.progress``. Returns the seconds each send took.
    """
    sender = RefitSender(model, rendezvous=ctx.rendezvous, rank=rank, world_size=world,
                         options=RefitOptions(**ctx.options))
    began = time.perf_counter()
    schedule = sender.setup()
    if rank == 0:
        ctx.progress.planned(schedule, time.perf_counter() - began, sender.setup_times)
    seconds = []
    for step in range(ctx.steps):
        load(step)
        seconds.append(sender.send(version=step).seconds)
    sender.close()
    return seconds


def train_demo(ctx: DemoContext, rank_program: Callable[..., list[float]], *args: Any) -> DemoReport:
    """A train program: ``ctx.layout.world_size`` processes run ``rank_program(rank, world, ctx, *args)``
    (a top-level function returning :func:`send_versions`' seconds); the report holds the slowest rank's
    time per step."""
    per_rank = spawn(rank_program, ctx.layout.world_size, ctx, *args)
    return DemoReport(True, seconds_per_step=[max(step) for step in zip(*per_rank)])
