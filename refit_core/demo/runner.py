"""``refit demo``: start the train and gen programs, wait for both, summarize in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from ..backend import GEN, TRAIN, Backend
from ..errors import RefitError
from ..launch import free_port
from ..plugins import PluginManager
from ..units import format_bytes
from .context import DemoReport


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


def pick_pair(pm: PluginManager, train: str | None, gen: str | None) -> tuple[Backend, Backend]:
    """The requested backends, or the best installed ones (highest priority) for each side."""
    def best(side: str, name: str | None) -> Backend:
        if name is not None:
            return pm.backend(name, side)
        runnable = [b for b in pm.backends(side) if (b.demo_train if side == TRAIN else b.demo_gen)]
        if not runnable:
            raise RefitError(f"no installed plugin provides a {side} demo; install refit-plugin-dtensor "
                             "and/or refit-plugin-vllm (installed plugins: "
                             f"{', '.join(p.name for p in pm.plugins) or 'none'})")
        return max(runnable, key=lambda b: b.priority)
    return best(TRAIN, train), best(GEN, gen)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def fit_to_gpus(plan: DemoPlan) -> DemoPlan:
    """Default layouts shrunk to one rank a side when the GPUs cannot give every rank its own
    (NCCL cannot connect two ranks on one GPU)."""
    from dataclasses import replace

    from ..layout import ParallelLayout

    needed = ParallelLayout.parse(plan.train_layout).world_size + ParallelLayout.parse(plan.gen_layout).world_size
    if needed <= torch.cuda.device_count():
        return plan
    print(f"refit demo: {needed} ranks need {needed} GPUs, {torch.cuda.device_count()} present: "
          "running one rank a side (pass --train-layout/--gen-layout to choose)", flush=True)
    return replace(plan, train_layout="", gen_layout="")


def _side_command(plan: DemoPlan, side: str, rendezvous: str, report: str, options: dict) -> list[str]:
    backend, peer = (plan.train, plan.gen) if side == TRAIN else (plan.gen, plan.train)
    layout = plan.train_layout if side == TRAIN else plan.gen_layout
    return [sys.executable, "-m", "refit_core.demo.side", "--side", side, "--backend", backend.name,
            "--peer-backend", peer.name, "--model", plan.model, "--layout", layout,
            "--steps", str(plan.steps), "--rendezvous", rendezvous, "--device", plan.device,
            "--options", json.dumps(options), "--report", report]


def run_demo(plan: DemoPlan, *, timeout_s: float = 900.0, options: dict | None = None) -> tuple[bool, list[str]]:
    """Run both programs; returns (ok, lines to print, the last one a summary)."""
    rendezvous = f"127.0.0.1:{free_port()}"
    options = {"timeout_s": min(timeout_s, 300.0), **(options or {})}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="refit-demo-") as tmp:
        reports = {side: os.path.join(tmp, f"{side}.json") for side in (TRAIN, GEN)}
        procs = {side: subprocess.Popen(_side_command(plan, side, rendezvous, reports[side], options))
                 for side in (TRAIN, GEN)}
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs.values()):
                time.sleep(2.0)  # give the other side a moment to fail on its own, then stop it
                break
            time.sleep(0.1)
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        results = {}
        for side, path in reports.items():
            if os.path.exists(path):
                with open(path) as f:
                    results[side] = DemoReport(**json.load(f))
            else:
                results[side] = DemoReport(False, [f"{side} program exited with {procs[side].returncode} "
                                                   "before reporting (killed or timed out)"])
    ok = all(r.ok for r in results.values())
    lines = [line for side in (TRAIN, GEN) for line in results[side].lines]
    gen = results[GEN]
    step = f", step {1000 * min(gen.seconds_per_step):.1f} ms" if gen.seconds_per_step else ""
    size = f", {format_bytes(gen.bytes_per_step)}/step" if gen.bytes_per_step else ""
    lines.append(f"refit demo: {plan.train.name}({plan.train_layout or 'single'}) -> "
                 f"{plan.gen.name}({plan.gen_layout or 'single'}), {plan.model}, {plan.steps} steps on "
                 f"{plan.device}{size}{step}, {time.perf_counter() - start:.1f} s: "
                 + ("verified OK" if ok else "FAILED"))
    return ok, lines
