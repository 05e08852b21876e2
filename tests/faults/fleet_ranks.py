"""Rank programs for the fleet tests: toy trainers that refit a fleet step by step (each step once the test
opens its gate), and toy engine replicas that join it, check every version they receive bitwise, and join
again after a failed step; the fleet campaign's replicas may be struck (killed or stopped) at a point of a
step, and log what they did to a file."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitError, RefitOptions, RefitReceiver
from refit_core.apps import FleetStepError, RefitFleet, join_fleet
from refit_core.kit.verify import mismatches

FIRST_VERSION = 100
WEIGHTS = 3
"""Step ``s`` sends the reference weights ``s % WEIGHTS``: a replica one step behind holds other bytes."""


def weights_of(version: int) -> int:
    return (version - FIRST_VERSION) % WEIGHTS


def options(**extra: object) -> RefitOptions:
    return RefitOptions(**{"timeout_s": 10, "bucket_bytes": 1024, "num_buffers": 2, **extra})


def gate(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def trainer_rank(rank: int, report, address: str, train: int, steps: int, folder: str,
                 settings: dict | None = None) -> dict:
    """Train rank ``rank`` of ``train``: open the fleet once, then ``steps`` steps, step ``s`` once the file
    ``gate(folder, s)`` exists; reports each step's :class:`FleetStep`. ``settings``: more options."""
    model = ToyTrainer(rank, train)
    fleet = RefitFleet(model, rendezvous=address, rank=rank, world_size=train, options=options(**(settings or {})))
    fleet.open()
    opened = 1
    for step in range(steps):
        while not os.path.exists(gate(folder, step)):
            time.sleep(0.01)
        model.load(reference(0, step % WEIGHTS))
        raised = None
        try:
            result = fleet.send(FIRST_VERSION + step)
        except FleetStepError as exc:  # strict membership
            result, raised = exc.result, str(exc)
        report("step", {"step": step, "landed": list(result.landed), "joined": list(result.joined),
                        "failed": {f.replica: f.reason for f in result.failed}, "seconds": result.seconds,
                        "feeders": {s.replica: s.feeder for s in fleet.fleet()}, "raised": raised})
    view = [(s.replica, s.version, s.gen_ranks, s.layout, s.last_error) for s in fleet.fleet()]
    fleet.close()
    return {"opened": opened, "fleet": view}


Arm = Callable[[RefitReceiver, int], Callable[[bool], None] | None]
"""Called before a replica's ``count``-th receive since its first join; what it returns (if anything) is called
once that receive ended (True: it returned)."""


def serve(engine: ToyEngine, join: Callable[[], RefitReceiver], last: int, note: Callable[[str, Any], None],
          arm: Arm | None = None) -> dict:
    """A replica rank's life: join, then receive until version ``last``, noting each version held and whether it
    is bitwise the trainers'; after a failed step, join again. A refused join raises."""
    held, joins = [], 0
    while True:
        note("joining", joins)
        receiver = join()
        joins += 1
        try:
            for count in itertools.count():
                after = arm(receiver, count) if arm is not None and joins == 1 else None
                try:
                    receiver.receive()
                except RefitError:
                    if after is not None:
                        after(False)
                    raise
                version = receiver.version
                pieces = receiver.plugins.destination_map(engine).pieces
                bitwise = not mismatches(pieces, reference(0, weights_of(version)))
                held.append((version, bitwise))
                note("held", (version, bitwise))
                if after is not None:
                    after(True)
                if version == last:
                    receiver.close()
                    return {"held": held, "joins": joins}
        except RefitError as exc:
            note("failed", str(exc)[:300])
            receiver.close()


def replica_rank(rank: int, report, address: str, replica: str, local: int, size: int, last: int) -> dict:
    """Rank ``local`` of replica ``replica`` (``size`` ranks): join, then receive until version ``last``,
    reporting each version held and whether it is bitwise the trainers'; after a failed step, join again (a join
    whose feeder lost the step is tried again)."""
    engine = ToyEngine(local, size)

    def join() -> RefitReceiver:
        while True:
            try:
                return join_fleet(engine, fleet=address, replica=replica, rank=local, world_size=size,
                                  options=options(), join_timeout_s=60)
            except RefitError as exc:
                if "cannot get its first step" not in str(exc):
                    raise
                report("failed", str(exc)[:300])
    return serve(engine, join, last, report)


def impostor_rank(rank: int, report, address: str, replica: str) -> dict:
    """A second replica under a name already in the fleet: its join must be refused by name."""
    try:
        join_fleet(ToyEngine(0, 1), fleet=address, replica=replica, rank=0, world_size=1, options=options(),
                   join_timeout_s=60)
    except RefitError as exc:
        return {"error": str(exc)}
    return {"error": None}


def deserter_rank(rank: int, report, address: str, replica: str) -> dict:
    """A replica rank that dies right after the fleet admitted it, before its job's setup: the process exits
    where its receiver's ``setup()`` would start."""
    from refit_core.fleet.replica import ReplicaReceiver

    def die(self: ReplicaReceiver) -> None:
        os._exit(0)

    ReplicaReceiver.setup = die  # type: ignore[method-assign]
    join_fleet(ToyEngine(0, 1), fleet=address, replica=replica, rank=0, world_size=1, options=options(),
               join_timeout_s=60)
    return {}


# -- the fleet campaign's replicas ------------------------------------------------------------------------


class Point(StrEnum):
    """Where in its step a struck replica rank is hit."""

    TRANSFER = "transfer"
    """Inside the transfer, before the rank's ``exchange``-th exchange of the step."""
    AFTER_VOTE = "after_vote"
    """Right after its vote that it landed the step."""
    AFTER_SETTLE = "after_settle"
    """Staged: right after it reported that it applied train rank 0's decision."""
    BETWEEN = "between"
    """Right after ``receive()`` returned: between this step and the next."""
    FORWARD = "forward"
    """A feeder replica's rank, inside its forwarding of the step to the first replica it feeds, before its
    ``exchange``-th exchange there (a relay parent struck mid-step)."""


class Action(StrEnum):
    """What hits the rank."""

    KILL = "kill"
    """SIGKILL."""
    STOP = "stop"
    """SIGSTOP, never continued (the campaign kills it later)."""


@dataclass(frozen=True)
class Hit:
    """A strike on one replica rank: ``action`` at ``point`` of fleet step ``step`` (of its first incarnation,
    which joined for step 0; ``exchange``: which exchange, at :attr:`Point.TRANSFER`)."""

    step: int
    point: Point
    action: Action
    exchange: int = 1


class RankLog:
    """What a campaign replica rank did, one JSON line per event appended to its own file: a line written
    survives a SIGKILL right after it (a queue's feeder thread may not), and the campaign reads it between steps."""

    def __init__(self, folder: str, rank: int) -> None:
        self.path = os.path.join(folder, f"rank-{rank}.log")

    def note(self, event: str, value: Any = None) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, json.dumps([event, value]).encode() + b"\n")
        finally:
            os.close(fd)

    def read(self) -> list[tuple[str, Any]]:
        """The events noted so far, in order (none before the first)."""
        try:
            with open(self.path) as f:
                return [tuple(json.loads(line)) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []


def _note_asks(log: RankLog) -> None:
    """Note "asked" once this process's join request is in the fleet's store (``join_fleet`` then waits for its
    admission)."""
    from refit_core.fleet import replica as module
    from refit_core.fleet.records import admit_key

    class Asking(module.Rendezvous):  # type: ignore[name-defined,misc]
        def wait(self, keys: list[str], *args: Any, **kwargs: Any) -> list[Any]:
            if keys[0].startswith(admit_key(0).rstrip("0")):
                log.note("asked")
            return super().wait(keys, *args, **kwargs)
    module.Rendezvous = Asking  # type: ignore[misc]


def _strike_in(transport: Any, exchange: int, strike: Callable[[], None]) -> Callable[[], None]:
    """Make ``transport`` call ``strike`` before its ``exchange``-th exchange; what undoes that."""
    real_exchange, calls = transport.exchange, [0]

    def exchanging(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == exchange:
            strike()
        return real_exchange(*args, **kwargs)
    transport.exchange = exchanging
    return lambda: setattr(transport, "exchange", real_exchange)


def _arm(hit: Hit, log: RankLog) -> Arm:
    """What installs ``hit`` in this process for the step it names (see :data:`Arm`)."""
    from refit_core.endpoints import commit

    def strike() -> None:
        log.note("struck", hit.step)
        os.kill(os.getpid(), signal.SIGKILL if hit.action is Action.KILL else signal.SIGSTOP)

    def arm(receiver: RefitReceiver, count: int) -> Callable[[bool], None] | None:
        if count != hit.step:
            return None
        undo: list[Callable[[], None]] = []
        if hit.point is Point.TRANSFER:
            undo.append(_strike_in(receiver._executor.transport, hit.exchange, strike))
        elif hit.point is Point.FORWARD:
            from refit_core.fleet.mirror import MirrorSender

            receiver.wait_forwarded()  # the last step's forwarding is not this step's
            real_send = MirrorSender.send

            def send(self: MirrorSender, version: int, **kwargs: Any) -> Any:
                MirrorSender.send = real_send  # type: ignore[method-assign]  # the first child only
                restore = _strike_in(self.transport, hit.exchange, strike)
                try:
                    return real_send(self, version, **kwargs)
                finally:
                    restore()
            MirrorSender.send = send  # type: ignore[method-assign]
            undo.append(lambda: setattr(MirrorSender, "send", real_send))
        elif hit.point in (Point.AFTER_VOTE, Point.AFTER_SETTLE):
            name = "vote" if hit.point is Point.AFTER_VOTE else "settle"
            real = getattr(commit, name)

            def struck(*args: Any, **kwargs: Any) -> Any:
                result = real(*args, **kwargs)
                if name == "settle" or args[2].landed:
                    strike()
                return result
            setattr(commit, name, struck)
            undo.append(lambda: setattr(commit, name, real))

        def after(returned: bool) -> None:
            if hit.point is Point.FORWARD and returned:
                receiver.wait_forwarded()  # it forwards once receive() returned
            for step in undo:
                step()
            if hit.point is Point.BETWEEN and returned:
                strike()  # never returns
            else:
                log.note("missed", hit.step)
        return after
    return arm


REFUSALS = ("refused replica", "is already connected to this refit fleet")
"""How a refused join says so: by train rank 0 (a name in use, a limit), or by the fleet's store (a rank of that
replica is connected to it now, joining)."""


def start_path(folder: str, rank: int) -> str:
    """The file a campaign replica rank started ahead waits for before it first joins."""
    return os.path.join(folder, f"start-{rank}")


def fleet_rank(rank: int, report, address: str, replica: str, local: int, size: int, last: int, settings: dict,
               folder: str, hit: Hit | None, ahead: bool = False) -> dict:
    """A campaign replica rank (:func:`serve`), noting its events in its :class:`RankLog` (``asked`` once its
    join request is in; a join whose setup failed is tried again; a refused join notes ``refused`` and the
    reason, and the rank ends); ``hit``: its strike; ``ahead``: it first waits for :func:`start_path`."""
    log = RankLog(folder, rank)
    _note_asks(log)
    engine = ToyEngine(local, size)
    while ahead and not os.path.exists(start_path(folder, rank)):
        time.sleep(0.01)

    def join() -> RefitReceiver:
        while True:
            try:
                return join_fleet(engine, fleet=address, replica=replica, rank=local, world_size=size,
                                  options=options(**settings), join_timeout_s=600)
            except RefitError as exc:
                if any(refusal in str(exc) for refusal in REFUSALS):
                    raise
                log.note("failed", str(exc)[:300])
                log.note("joining", None)
    try:
        return serve(engine, join, last, log.note, None if hit is None else _arm(hit, log))
    except RefitError as exc:
        log.note("refused", str(exc)[:500])
        return {"refused": str(exc)}
