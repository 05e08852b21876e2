"""Rank programs for the fleet tests: toy trainers that refit a fleet step by step (each step once the test
opens its gate), and toy engine replicas that join it, check every version they receive bitwise, and join
again after a failed step."""

from __future__ import annotations

import os
import time

from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitError, RefitOptions
from refit_core.apps import RefitFleet, join_fleet
from refit_core.kit.verify import mismatches

FIRST_VERSION = 100
WEIGHTS = 3
"""Step ``s`` sends the reference weights ``s % WEIGHTS``: a replica one step behind holds other bytes."""


def weights_of(version: int) -> int:
    return (version - FIRST_VERSION) % WEIGHTS


def options(**extra: object) -> RefitOptions:
    return RefitOptions(timeout_s=10, bucket_bytes=1024, num_buffers=2, **extra)


def gate(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def trainer_rank(rank: int, report, address: str, train: int, steps: int, folder: str) -> dict:
    """Train rank ``rank`` of ``train``: open the fleet once, then ``steps`` steps, step ``s`` once the file
    ``gate(folder, s)`` exists; reports each step's :class:`FleetStep`."""
    model = ToyTrainer(rank, train)
    fleet = RefitFleet(model, rendezvous=address, rank=rank, world_size=train, options=options())
    fleet.open()
    opened = 1
    for step in range(steps):
        while not os.path.exists(gate(folder, step)):
            time.sleep(0.01)
        model.load(reference(0, step % WEIGHTS))
        result = fleet.send(FIRST_VERSION + step)
        report("step", {"step": step, "landed": list(result.landed), "joined": list(result.joined),
                        "failed": {f.replica: f.reason for f in result.failed}, "seconds": result.seconds})
    view = [(s.replica, s.version, s.gen_ranks, s.layout, s.last_error) for s in fleet.fleet()]
    fleet.close()
    return {"opened": opened, "fleet": view}


def replica_rank(rank: int, report, address: str, replica: str, local: int, size: int, last: int) -> dict:
    """Rank ``local`` of replica ``replica`` (``size`` ranks): join, then receive until version ``last``,
    reporting each version held and whether it is bitwise the trainers'; after a failed step, join again."""
    engine = ToyEngine(local, size)
    held, joins = [], 0
    while True:
        report("joining", joins)
        receiver = join_fleet(engine, fleet=address, replica=replica, rank=local, world_size=size, options=options(),
                              join_timeout_s=60)
        joins += 1
        try:
            while True:
                receiver.receive()
                version = receiver.version
                pieces = receiver.plugins.destination_map(engine).pieces
                bitwise = not mismatches(pieces, reference(0, weights_of(version)))
                held.append((version, bitwise))
                report("held", (version, bitwise))
                if version == last:
                    receiver.close()
                    return {"held": held, "joins": joins}
        except RefitError as exc:
            report("failed", str(exc)[:300])
            receiver.close()


def impostor_rank(rank: int, report, address: str, replica: str) -> dict:
    """A second replica under a name already in the fleet: its join must be refused by name."""
    try:
        join_fleet(ToyEngine(0, 1), fleet=address, replica=replica, rank=0, world_size=1, options=options(),
                   join_timeout_s=60)
    except RefitError as exc:
        return {"error": str(exc)}
    return {"error": None}
