"""What a backend's demo program receives (context, progress reporter) and returns (report)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from refit_core.contract.layout import ParallelLayout
from refit_core.contract.options import Colocation
from refit_core.contract.spec import TensorSpec
from refit_core.units import format_bytes

if TYPE_CHECKING:
    import torch

    from refit_core.plan.schedule import Schedule
    from refit_core.run.setuptime import SetupTimes


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
        endpoint's :attr:`~refit_core.sender.RefitSender.setup_times`) a second line breaks setup down."""
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
