"""``refit demo``: start the train and gen programs, show their phases, summarize in one line.

Each program runs in its own session with its output in a log file (``train.log``, ``gen.log`` in
a fresh directory that is kept); the console gets only the phase lines the programs report
(``events.jsonl``), their verdicts and a one-line summary. Both process groups are killed before
``run_demo`` returns, so no rank process or engine worker outlives a failed demo.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from refit_core.contract.backend import GEN, TRAIN, Backend
from refit_core.contract.env import read
from refit_core.contract.errors import RefitError
from refit_core.contract.options import Colocation
from refit_core.contract.plugins import PluginManager
from refit_core.contract.side import Side
from refit_core.kit.demo import DemoReport, ProgressEvent, installed_demos
from refit_core.kit.launch import free_port
from refit_core.net.auth import new_secret
from refit_core.units import format_bytes


@dataclass
class DemoPlan:
    """What ``refit demo`` will run."""

    train: Backend
    gen: Backend
    model: str
    train_layout: str
    gen_layout: str
    steps: int
    device: str
    colocate: bool = False
    """Train and gen ranks share devices: the gen side's ranks use the trainer's GPUs (CUDA IPC for
    same-GPU pairs) or, on CPU, same-host pairs go through shared memory."""
    quantize: str | None = None
    """``fp8``: the gen side holds block-FP8 weights (quantized by refit from the trainer's)."""


def pick_pair(pm: PluginManager, train: str | None, gen: str | None) -> tuple[Backend, Backend]:
    """The requested backends, or the best installed ones (highest demo priority) for each side."""
    demos = installed_demos(pm)

    def best(side: Side, name: str | None) -> Backend:
        if name is not None:
            return pm.backend(name, side)
        runnable = [b for b in pm.backends(side) if demos.of(b.name).program(side)]
        if not runnable:
            raise RefitError(f"no installed plugin provides a {side} demo; install refit-plugin-dtensor "
                             "and/or refit-plugin-vllm (installed plugins: "
                             f"{', '.join(p.name for p in pm.plugins) or 'none'})")
        return max(runnable, key=lambda b: demos.of(b.name).priority)
    return best(TRAIN, train), best(GEN, gen)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def fit_to_gpus(plan: DemoPlan, train_given: bool, gen_given: bool, gpus: int | None = None) -> DemoPlan:
    """``plan`` with layouts that fit the ``gpus`` present (default: this machine's), each shrunk
    default printed; raises :class:`RefitError` before anything starts if a given layout cannot fit
    (:func:`~refit_core.tools.demo.fit.fit_layouts`). CPU plans are returned unchanged."""
    from dataclasses import replace

    from refit_core.tools.demo.fit import SideLayout, fit_layouts

    if plan.device != "cuda":
        return plan
    fitted = fit_layouts(SideLayout(TRAIN, plan.train.name, plan.train_layout, train_given),
                         SideLayout(GEN, plan.gen.name, plan.gen_layout, gen_given),
                         torch.cuda.device_count() if gpus is None else gpus, colocate=plan.colocate)
    for note in fitted.notes:
        print(f"refit demo: {note}", flush=True)
    return replace(plan, train_layout=fitted.train_layout, gen_layout=fitted.gen_layout)


def _side_command(plan: DemoPlan, side: str, rendezvous: str, files: SideFiles, events: str,
                  options: dict) -> list[str]:
    backend, peer = (plan.train, plan.gen) if side == TRAIN else (plan.gen, plan.train)
    layout = plan.train_layout if side == TRAIN else plan.gen_layout
    return [sys.executable, "-m", "refit_core.tools.demo.side", "--side", side, "--backend", backend.name,
            "--peer-backend", peer.name, "--model", plan.model, "--layout", layout,
            "--steps", str(plan.steps), "--rendezvous", rendezvous, "--device", plan.device,
            "--options", json.dumps(options), "--report", files.report, "--events", events,
            *(["--quantize", plan.quantize] if plan.quantize else [])]


@dataclass(frozen=True)
class SideFiles:
    """Where one side's program writes: its whole output (``log``) and its final ``report``."""

    log: str
    report: str


@dataclass(frozen=True)
class DemoOutcome:
    """What ``refit demo`` ran into: ``ok`` only if both sides verified; ``log_dir`` holds the logs."""

    ok: bool
    log_dir: str
    summary: str


def side_environment(options: dict, environ: Mapping[str, str]) -> dict[str, str]:
    """The side programs' environment: ``environ``, and in ``REFIT_SECRET`` the job's secret, the same
    for both sides: ``environ``'s own, else ``options["secret"]`` (taken out of ``options``: a command
    line is visible to every local user), else a fresh random one."""
    given = options.pop("secret", None)
    secret = read("REFIT_SECRET", environ) or given or new_secret()
    return {**environ, "PYTHONUNBUFFERED": "1", "REFIT_SECRET": secret}


class _SideProcess:
    """One side's program in its own session, so that it and every process it starts can be killed."""

    def __init__(self, side: str, command: list[str], files: SideFiles, env: dict[str, str]) -> None:
        self.side = side
        self.files = files
        with open(files.log, "w") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)
        self.failed_at: float | None = None
        self.stopped = False

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code not in (None, 0) and self.failed_at is None:
            self.failed_at = time.monotonic()
        return code

    def kill_all(self) -> None:
        """Kill the side's whole process group (its rank processes and engine workers too)."""
        self.stopped = self.proc.poll() is None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def report(self) -> DemoReport:
        if os.path.exists(self.files.report):
            with open(self.files.report) as f:
                return DemoReport(**json.load(f))
        if self.stopped:
            why = f"{self.side} program stopped by refit demo (the other side failed, or the time ran out)"
            return DemoReport(False, [why + ", its processes killed"])
        return DemoReport(False, [f"{self.side} program exited with {self.proc.returncode} before reporting"])


class _EventPrinter:
    """Prints the phase lines both sides append to the events file, as they arrive."""

    def __init__(self, path: str, echo: Callable[[str], None]) -> None:
        self.path = path
        self.echo = echo
        self.offset = 0

    def drain(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            event = ProgressEvent.from_json(line)
            self.echo(f"  {event.label:<7} {event.side}: {event.text}")


def error_lines(log_path: str, limit: int = 12) -> list[str]:
    """The last error of a side's log: its last traceback's innermost frame and exception, else
    the log's last lines."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return []
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    block = lines[starts[-1]:] if starts else lines
    frames = [i for i, line in enumerate(block) if line.lstrip().startswith('File "')]
    return (block[frames[-1]:] if frames else block)[:limit] if starts else block[-limit:]


def run_demo(plan: DemoPlan, *, timeout_s: float = 900.0, options: dict | None = None,
             echo: Callable[[str], None] = print) -> DemoOutcome:
    """Run both programs, print one line per phase through ``echo`` and return the outcome.

    Everything the programs print (engine and rank logs) goes to log files in a fresh directory,
    kept afterwards; on failure the failing side's last error lines are echoed with the log's path.
    Both programs and every process they started are killed before this returns.
    """
    rendezvous = f"127.0.0.1:{free_port()}"
    options = {"timeout_s": min(timeout_s, 300.0), **(options or {})}
    if plan.colocate:
        options.setdefault("colocate", Colocation.SHARED.value)
    env = side_environment(options, os.environ)
    start = time.perf_counter()
    log_dir = tempfile.mkdtemp(prefix="refit-demo-")
    events = _EventPrinter(os.path.join(log_dir, "events.jsonl"), echo)
    echo(f"  logs    {log_dir}/{{{TRAIN},{GEN}}}.log")
    sides: dict[str, _SideProcess] = {}
    try:
        for side in (TRAIN, GEN):
            files = SideFiles(os.path.join(log_dir, f"{side}.log"), os.path.join(log_dir, f"{side}.json"))
            sides[side] = _SideProcess(side, _side_command(plan, side, rendezvous, files, events.path, options),
                                       files, env)
        _wait(list(sides.values()), time.monotonic() + timeout_s, events)
    finally:
        for process in sides.values():
            process.kill_all()
    events.drain()
    reports = {side: process.report() for side, process in sides.items()}
    ok = len(reports) == 2 and all(r.ok for r in reports.values())
    first_failed = sorted(sides.values(), key=lambda p: (p.failed_at is None, p.failed_at or 0.0))
    for process in first_failed:
        for line in reports[process.side].lines:
            echo(f"  {'verify' if ok else 'failed':<7} {process.side}: {line}")
    if not ok:
        _explain_failure(list(sides.values()), reports, echo)
    gen = reports.get(GEN, DemoReport(False))
    step = f", step {1000 * min(gen.seconds_per_step):.1f} ms" if gen.seconds_per_step else ""
    size = f", {format_bytes(gen.bytes_per_step)}/step" if gen.bytes_per_step else ""
    where = f"{plan.device}, colocated" if plan.colocate else plan.device
    summary = (f"refit demo: {plan.train.name}({plan.train_layout or 'single'}) -> "
               f"{plan.gen.name}({plan.gen_layout or 'single'}{', ' + plan.quantize if plan.quantize else ''}), "
               f"{plan.model}, {plan.steps} steps on "
               f"{where}{size}{step}, {time.perf_counter() - start:.1f} s: "
               + ("verified OK" if ok else f"FAILED (logs: {log_dir})"))
    return DemoOutcome(ok, log_dir, summary)


def _wait(sides: list[_SideProcess], deadline: float, events: _EventPrinter) -> None:
    """Until both programs exit, one fails (plus a moment for the other to fail on its own), or the deadline."""
    while time.monotonic() < deadline:
        events.drain()
        codes = [p.poll() for p in sides]
        if all(code is not None for code in codes):
            return
        failed = [p.failed_at for p in sides if p.failed_at is not None]
        if failed and time.monotonic() - min(failed) > 2.0:
            return
        time.sleep(0.1)


def _explain_failure(sides: list[_SideProcess], reports: dict[str, DemoReport], echo: Callable[[str], None]) -> None:
    """The last error lines of the side(s) that failed on their own (not those stopped afterwards)."""
    failing = sorted((p for p in sides if p.failed_at is not None), key=lambda p: p.failed_at or 0.0)
    for process in failing[:1] or sides:
        lines = error_lines(process.files.log)
        if lines:
            echo(f"  last lines of {process.files.log}:")
            for line in lines:
                echo(f"    {line}")
