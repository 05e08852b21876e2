"""Where one colocated step's time goes: host timestamps on each rank, device time of the copies.

Off by default (``RefitOptions(step_trace=True)`` turns it on); read back after a step as
``RefitSender.colocated_trace`` / ``RefitReceiver.colocated_trace``. Host marks are
``time.perf_counter()`` values, which on Linux read ``CLOCK_MONOTONIC``: the marks of two processes of
one host are on one clock, so the time from the trainer's *ready* to the engine seeing it is a plain
difference (:func:`breakdown`).

Marks, train rank: ``start`` (``send`` entered), ``checked`` (the moved-parameter check done),
``posted`` (*ready* written), ``done_seen`` (every peer's *done* read), ``end`` (``send`` returns).
Gen rank: ``start``, ``ready_seen`` (every header read and checked), ``enqueue_begin``,
``enqueued`` (every copy queued), ``gpu_done_seen`` (the copies' completion observed),
``done_posted``. On CUDA the gen rank also records device milliseconds: ``wait`` (from the moment
it began queueing until its stream passed the trainer's and the engine's events), then one entry per
launch group of the copy program (:data:`refit_core.run.copies.CATEGORIES`), and ``copies`` (their sum).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class StepTrace:
    """One rank's record of one colocated step (mutable while the step runs)."""

    marks: dict[str, float] = field(default_factory=dict)
    """Host timestamps (seconds, ``time.perf_counter``) by name."""
    gpu_ms: dict[str, float] = field(default_factory=dict)
    """Device milliseconds by phase (gen rank on CUDA only)."""

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def device_phases(self, queued: torch.cuda.Event, marks: list[tuple[str, torch.cuda.Event]]) -> None:
        """Fill :attr:`gpu_ms` from ``queued`` (recorded before the stream's waits) and the copy
        program's ``[("begin", e), (group, e), ...]`` events; all must have completed."""
        if not marks:
            return
        self.gpu_ms["wait"] = queued.elapsed_time(marks[0][1])
        for (_, before), (name, after) in zip(marks, marks[1:]):
            self.gpu_ms[name] = before.elapsed_time(after)
        self.gpu_ms["copies"] = marks[0][1].elapsed_time(marks[-1][1])


def breakdown(train: StepTrace, gen: StepTrace) -> dict[str, float]:
    """One step of a colocated pair split into phases, in milliseconds (the two traces of one step).

    ``check``: the trainer's moved-parameter check (before *ready*, or after it with ``overlap_check``,
    then off the critical path); ``post``: writing *ready*;
    ``signal``: *ready* written -> the engine has read and checked it; ``enqueue``: the engine's host
    time queueing its copies; ``device_wait``/``device_<group>``: device time (CUDA); ``tail``: the
    copies' end (estimated: queueing began + device wait + copies) -> the engine saw it (``observe``)
    -> the trainer read *done* (``ack``); ``after``: the trainer's own work after *done*; ``total``.
    """
    t, g = train.marks, gen.marks
    if t["checked"] <= t["posted"]:  # the check, then *ready*
        check, post = t["checked"] - t["start"], t["posted"] - t["checked"]
    else:  # overlap_check: *ready* first, the check while the engine copies
        check, post = t["checked"] - t["posted"], t["posted"] - t["start"]
    ms = {"total": t["end"] - t["start"], "check": check, "post": post,
          "signal": g["ready_seen"] - t["posted"], "enqueue": g["enqueued"] - g["ready_seen"],
          "ack": t["done_seen"] - g["gpu_done_seen"], "after": t["end"] - t["done_seen"]}
    out = {k: 1000 * v for k, v in ms.items()}
    if gen.gpu_ms:
        for name, value in gen.gpu_ms.items():
            out[f"device_{name}"] = value
        gpu_end = 1000 * g["enqueue_begin"] + gen.gpu_ms["wait"] + gen.gpu_ms["copies"]
        out["observe"] = 1000 * g["gpu_done_seen"] - gpu_end
        out["tail"] = 1000 * t["done_seen"] - gpu_end
    else:
        out["observe"] = 1000 * (g["gpu_done_seen"] - g["enqueued"])
    return out


__all__ = ["StepTrace", "breakdown"]
