"""What the per-step check of the bound memory costs, alone, on the CPU: ``python benchmarks/bound_check.py``.

Before any byte of a step moves, each rank checks that the model's tensors are still the memory refit bound
(:mod:`refit_core.endpoints.binding`): the same objects at the same addresses, so that a rebinding
(``param.data = ...``), ``set_()``, a resize or a freed storage is named instead of sent or served stale.
This times that check, nothing else (not the plugin's listing of its tensors or pieces), at two shapes:
the Llama-3-8B shape (291 tensors) and the Qwen3-30B-A3B shape (18,867 tensors: every expert its own
tensor, as a trainer holds them), each tensor named as the checkpoint names it.

Each tensor is a real one-element tensor with a storage of its own (not the meta device: the check reads
addresses, and a meta tensor has none), on the CPU, and on the GPU too where CUDA is available (``--device``):
the check reads each tensor's object and address, never its bytes, on the CPU whichever device the tensor is
on, so its cost depends on the number of tensors, not on their sizes: one-element tensors give the cost of the
real model's.

Two paths, as a plugin implements them: ``listed`` (``refit_model_tensors``) and ``pieces`` (no such hook:
the pieces the plugin hands, compared by spec and box, then as ``listed``), each two ways, side by side:
``compiled``, one loop of :mod:`refit_core.endpoints.compiled_check` (built first, once per machine), and
``python``, where no compiler is: two ``map`` passes, the tensors' addresses, then their distinct storages'.
(One call of torch's ``_tensors_data_ptrs_at_indices_equal``, CUDA
builds only, over the tensors and a one-byte witness tensor per storage was measured slower on 4 x H200's
Xeon, 2.75 against 2.23 ms at 18,867 tensors, and was dropped; see
``benchmarks/results/cpu-bound-check-2026-11-28.md``.) Also ``before``: the check this replaced (the listed
objects' identity and addresses, no storage pass; it missed a rebinding whenever a plugin did not list its
tensors), and ``diagnosis``: a step that finds the last tensor's storage freed, named (the cost of a failure,
once). Times are the best and the median over ``--repeat`` checks of this thread's CPU time (the machine's
cores may be shared), and the median wall time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import is_, itemgetter

import torch

from refit_core.contract.pieces import SourcePiece
from refit_core.contract.spec import Box
from refit_core.endpoints.binding import BoundMemory, BoundTensors, CompiledRecord
from refit_core.endpoints.compiled_check import build
from refit_core.kit.models import PRESETS, checkpoint_specs


@dataclass(frozen=True)
class Shape:
    """A model shape and the per-step goal of its check (issue #44)."""

    preset: str
    goal_ms: float


SHAPES = (Shape("llama-3-8b-shape", 0.1), Shape("qwen3-30b-a3b-shape", 1.0))


@dataclass(frozen=True)
class Timing:
    """One path's times per check, in milliseconds."""

    best_cpu: float
    median_cpu: float
    median_wall: float


def timed(check: Callable[[], object], repeat: int) -> Timing:
    """Time ``check`` ``repeat`` times (after one warm-up call)."""
    check()
    cpu, wall = [], []
    for _ in range(repeat):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        check()
        cpu.append((time.thread_time_ns() - c0) / 1e6)
        wall.append((time.perf_counter_ns() - w0) / 1e6)
    return Timing(min(cpu), statistics.median(cpu), statistics.median(wall))


def model(preset: str, device: torch.device) -> list[SourcePiece]:
    """One source piece per checkpoint tensor of ``preset`` (per-expert names): its first element, a one-element
    tensor of its own on ``device``."""
    pieces = []
    for spec in checkpoint_specs(PRESETS[preset], grouped=False):
        ones = (1,) * len(spec.shape)
        view = torch.empty(ones, dtype=spec.dtype, device=device)
        pieces.append(SourcePiece(spec, Box((0,) * len(ones), ones), view))
    return pieces


def measure(pieces: list[SourcePiece], repeat: int) -> dict[str, Timing]:
    """Each path's times on ``pieces``: ``before`` and ``diagnosis`` once, ``listed`` and ``pieces`` per check."""
    listed = [(p.spec.name, p.view) for p in pieces]
    objects, addresses = tuple(map(itemgetter(1), listed)), tuple(p.view.data_ptr() for p in pieces)

    def before() -> bool:  # the check before issue #44: the same objects at the same addresses, no storage pass
        tensors = tuple(map(itemgetter(1), listed))
        return all(map(is_, tensors, objects)) and tuple(map(torch.Tensor.data_ptr, tensors)) == addresses

    timings = {"before": timed(before, repeat)}
    for compiled in (False, True):
        bound = replace(BoundTensors.listed(listed), compiled=CompiledRecord(allowed=compiled))
        memory = BoundMemory.after_bind([], [], None, pieces)
        memory = replace(memory, identity=replace(memory.identity, compiled=CompiledRecord(allowed=compiled)))
        assert bound.first_change(listed) is None and memory.first_piece_change(pieces) is None
        assert (bound.compiled.record is not None) is compiled, "the compiled check is not built: build() it first"
        how = "compiled" if compiled else "python"
        timings[f"listed, {how}"] = timed(lambda: bound.first_change(listed), repeat)
        timings[f"pieces, {how}"] = timed(lambda: memory.first_piece_change(pieces), repeat)
    freed = pieces[-1].view.clone()
    broken = BoundTensors.listed([*listed[:-1], ("freed", freed)])
    freed.untyped_storage().resize_(0)
    assert broken.first_change([*listed[:-1], ("freed", freed)]) is not None
    timings["diagnosis"] = timed(lambda: broken.first_change([*listed[:-1], ("freed", freed)]), max(3, repeat // 10))
    return timings


def cpu_name() -> str:
    """The CPU's model name (Linux), else its architecture."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="checks timed per shape and path")
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                        help="where the tensors live (all: the CPU, and the GPU where CUDA is available)")
    args = parser.parse_args()
    build()  # once per machine (about 20 s), then cached
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    devices = [torch.device("cpu")] if args.device != "cuda" else []
    devices += [torch.device("cuda")] if args.device != "cpu" and torch.cuda.is_available() else []
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), Python {platform.python_version()}, "
          f"{cpu_name()} ({os.cpu_count()} CPUs); best and median of {args.repeat} checks (this "
          f"thread's CPU time), median wall time\n")
    print("| device | shape | tensors | path | best | median | median wall | per tensor | goal |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for device in devices:
        for shape in SHAPES:
            pieces = model(shape.preset, device)
            for path, t in measure(pieces, args.repeat).items():
                goal = {"diagnosis": "(a failure)", "before": "(old check)"}.get(
                    path, f"< {shape.goal_ms:g} ms" if "compiled" in path else "(no compiler)")
                print(f"| {device.type} | {shape.preset} | {len(pieces):,} | {path} | {t.best_cpu:.3f} ms | "
                      f"{t.median_cpu:.3f} ms | {t.median_wall:.3f} ms | {1e6 * t.median_cpu / len(pieces):.0f} ns | "
                      f"{goal} |")


if __name__ == "__main__":
    main()
