"""Rank programs of two refit jobs that meet on one port: each job sends its own weights (its seed), and
each engine reports whose weights it holds, so a test can tell a byte of another job from its own."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.kit.verify import mismatches

SEEDS = (101, 202)
"""Job A's and job B's weights: ``reference(seed, 0)``."""


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _wait_for(gate: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} never appeared")
        time.sleep(0.05)


def job_rank(rank: int, report, address: str, train: bool, seed: int, options: dict, gate: str | None = None) -> dict:
    """The only train or gen rank of job ``seed``; waits for the file ``gate`` first when given. The train
    rank sends ``reference(seed, 0)`` as version ``seed``; the gen rank receives once. Returns the setup's
    error (if any), the seeds whose weights an engine holds at the end (``holds``; ``untouched``: still all
zeros, as it started: not one byte written), and the warnings refit logged."""
    if gate is not None:
        _wait_for(gate)
    warnings = _Warnings()
    logging.getLogger("refit").addHandler(warnings)
    model = ToyTrainer(0, 1) if train else ToyEngine(0, 1)
    endpoint = (RefitSender if train else RefitReceiver)(model, rendezvous=address, rank=0, world_size=1,
                                                         options=RefitOptions(**{"timeout_s": 20, **options}))
    result: dict = {"warnings": warnings.messages}
    try:
        endpoint.setup()
        if train:
            model.load(reference(seed, 0))
            endpoint.send(version=seed)
        else:
            result["version"] = endpoint.receive().version
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        result.update(error=type(exc).__name__, message=str(exc))
    finally:
        endpoint.close()
    if not train:
        pieces = endpoint.plugins.destination_map(model).pieces
        result["holds"] = [s for s in SEEDS if not mismatches(pieces, reference(s, 0))]
        result["untouched"] = not any(t.any() for t in (model.embed, model.qkv, model.experts_up, model.norm))
    return result
