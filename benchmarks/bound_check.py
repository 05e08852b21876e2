"""What the per-step check of the bound memory costs, alone, on CPU: ``python benchmarks/bound_check.py``.

Before any byte of a step moves, each rank checks that the model's tensors are still the memory refit bound
(:mod:`refit_core.endpoints.binding`): the same objects at the same addresses, so that a rebinding
(``param.data = ...``), ``set_()``, a resize or a freed storage is named instead of sent or served stale.
This times that check, nothing else (not the plugin's listing of its tensors or pieces), at two shapes:
the Llama-3-8B shape (291 tensors) and the Qwen3-30B-A3B shape (18,867 tensors: every expert its own
tensor, as a trainer holds them), each tensor named as the checkpoint names it.

Each tensor is a real one-element CPU tensor with a storage of its own (not the meta device: the check
reads addresses, and a meta tensor has none). The check reads each tensor's object and address, never its
bytes, so its cost depends on the number of tensors, not on their sizes: one-element tensors give the cost
of the real model's.

Two paths, as a plugin implements them: ``listed`` (``refit_model_tensors``: the tensors' addresses, then
their distinct storages' addresses) and ``pieces`` (no such hook: the pieces the plugin hands, compared by
spec and box, then as ``listed``). Also ``before``: the check this replaced (the listed objects' identity
and addresses, no storage pass; it missed a rebinding whenever a plugin did not list its tensors), and
``diagnosis``: a step that finds the last tensor's storage freed, named (the cost of a failure, once).
Times are the best and the median over ``--repeat`` checks of this thread's CPU time (the machine's cores
are shared), and the median wall time.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import is_, itemgetter

import torch

from refit_core.contract.pieces import SourcePiece
from refit_core.contract.spec import Box
from refit_core.endpoints.binding import BoundMemory, BoundTensors
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


def model(preset: str) -> list[SourcePiece]:
    """One source piece per checkpoint tensor of ``preset`` (per-expert names): its first element, a one-element
    tensor of its own."""
    pieces = []
    for spec in checkpoint_specs(PRESETS[preset], grouped=False):
        ones = (1,) * len(spec.shape)
        pieces.append(SourcePiece(spec, Box((0,) * len(ones), ones), torch.empty(ones, dtype=spec.dtype)))
    return pieces


def measure(shape: Shape, repeat: int) -> dict[str, Timing | int]:
    pieces = model(shape.preset)
    listed = [(p.spec.name, p.view) for p in pieces]
    bound = BoundTensors.listed(listed)
    memory = BoundMemory.after_bind([], [], None, pieces)
    assert bound.first_change(listed) is None and memory.first_piece_change(pieces) is None
    freed = torch.empty(1)
    broken = BoundTensors.listed([*listed[:-1], ("freed", freed)])
    freed.untyped_storage().resize_(0)
    assert broken.first_change([*listed[:-1], ("freed", freed)]) is not None
    objects, addresses = tuple(map(itemgetter(1), listed)), tuple(p.view.data_ptr() for p in pieces)

    def before() -> bool:  # the check before issue #44: the same objects at the same addresses, no storage pass
        tensors = tuple(map(itemgetter(1), listed))
        return all(map(is_, tensors, objects)) and tuple(map(torch.Tensor.data_ptr, tensors)) == addresses

    return {"tensors": len(listed),
            "before": timed(before, repeat),
            "listed": timed(lambda: bound.first_change(listed), repeat),
            "pieces": timed(lambda: memory.first_piece_change(pieces), repeat),
            "diagnosis": timed(lambda: broken.first_change([*listed[:-1], ("freed", freed)]), max(3, repeat // 10))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="checks timed per shape and path")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}; "
          f"best and median of {args.repeat} checks (this thread's CPU time), median wall time\n")
    print("| shape | tensors | path | best | median | median wall | per tensor | goal |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        result = measure(shape, args.repeat)
        count = result["tensors"]
        assert isinstance(count, int)
        for path in ("before", "listed", "pieces", "diagnosis"):
            t = result[path]
            assert isinstance(t, Timing)
            goal = {"diagnosis": "(a failure)", "before": "(old check)"}.get(path, f"< {shape.goal_ms:g} ms")
            print(f"| {shape.preset} | {count:,} | {path} | {t.best_cpu:.3f} ms | {t.median_cpu:.3f} ms | "
                  f"{t.median_wall:.3f} ms | {1e6 * t.median_cpu / count:.0f} ns | {goal} |")


if __name__ == "__main__":
    main()
