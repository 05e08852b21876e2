"""Rank programs for the fault tests: a toy refit (train ranks first, then gen ranks) in which one
rank kills (SIGKILL) or stops (SIGSTOP) itself in the middle of a step's transfer."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import big_model
import torch
from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.apps import same_bytes
from refit_core.kit.verify import reference_region

OLD_STEP, NEW_STEP = 0, 1  # reference weights of the good step and of the step the fault hits


@dataclass(frozen=True)
class Fault:
    """Which rank hurts itself, how, and after how many of its exchanges in the faulty step."""

    rank: int
    sig: int = signal.SIGKILL
    after_exchanges: int = 3
    delay_s: float | None = None
    """When set: signal ``delay_s`` after that exchange was posted (while its messages are in flight)."""


@dataclass(frozen=True)
class Scenario:
    train: int
    gen: int
    options: dict = field(default_factory=dict)
    fault: Fault | None = None
    recover: bool = False  # survivors close() and set up again on the same address, then refit once
    big: bool = False  # the big model (:mod:`big_model`, 1 MiB messages) instead of the toy one


def _inject(endpoint, fault: Fault) -> None:
    """Wrap the transport so that this process signals itself inside the next step's transfer."""
    transport = endpoint._executor.transport
    real = transport.exchange
    calls = {"n": 0}

    def exchange(sends, recvs, after=(), **options):
        calls["n"] += 1
        if calls["n"] == fault.after_exchanges:
            if fault.delay_s is None:
                os.kill(os.getpid(), fault.sig)
            else:
                threading.Timer(fault.delay_s, os.kill, (os.getpid(), fault.sig)).start()
        return real(sends, recvs, after, **options)

    transport.exchange = exchange


def _state(engine: ToyEngine, receiver: RefitReceiver) -> dict[str, str]:
    """Each destination tensor: "old" (step 0's values), "new" (step 1's) or "mixed"."""
    old, new = reference(0, OLD_STEP), reference(0, NEW_STEP)
    out = {}
    for piece in receiver.plugins.destination_map(engine).pieces:
        held = piece.view
        out[piece.spec.name] = ("old" if same_bytes(held, reference_region(piece, old)) else
                                "new" if same_bytes(held, reference_region(piece, new)) else "mixed")
    return out


def run_rank(rank: int, report, address: str, scenario: Scenario) -> dict:
    train = rank < scenario.train
    local, size = (rank, scenario.train) if train else (rank - scenario.train, scenario.gen)
    bucket = big_model.BUCKET_BYTES if scenario.big else 1024
    options = RefitOptions(**{"timeout_s": 8, "bucket_bytes": bucket, "num_buffers": 2, **scenario.options})
    if scenario.big:
        model = big_model.BigTrainer(local, size) if train else big_model.BigEngine(local, size)
    else:
        model = ToyTrainer(local, size) if train else ToyEngine(local, size)
    cls = RefitSender if train else RefitReceiver
    endpoint = cls(model, rendezvous=address, rank=local, world_size=size, options=options,
                   plugins=big_model.plugins() if scenario.big else None)
    endpoint.setup()
    outcome: dict = {"side": "train" if train else "gen"}
    for step in (OLD_STEP, NEW_STEP):
        if step == NEW_STEP and scenario.fault is not None and scenario.fault.rank == rank:
            _inject(endpoint, scenario.fault)
        start = time.monotonic()
        try:
            if train:
                model.load(big_model.reference(step) if scenario.big else reference(0, step))
                endpoint.send(version=100 + step)
            else:
                endpoint.receive()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            failure = getattr(exc, "failure", None)
            outcome.update(error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start,
                           torn=list(failure.torn) if failure else None)
            report("failed", outcome.get("error"))
            break
    if not train:
        state = model.state(OLD_STEP, NEW_STEP) if scenario.big else _state(model, endpoint)
        outcome.update(state=state, version=endpoint.version, needs_refit=endpoint.needs_refit,
                       engine_version=model.version, serves=_serves(model))
    if scenario.recover and "error" in outcome:
        endpoint.close()
        endpoint.options = dataclasses.replace(endpoint.options, timeout_s=90)  # the replacement starts slowly
        endpoint.setup()
        if train:
            model.load(reference(0, 5))
            endpoint.send(version=105)
        else:
            endpoint.receive()
            outcome.update(recovered=_state_against(model, endpoint, 5), recovered_version=endpoint.version,
                           serves_after=_serves(model))
    endpoint.close()
    return outcome


def replacement_rank(rank: int, report, address: str, scenario: Scenario) -> dict:
    """A fresh gen process taking a dead one's place: set up, receive once."""
    local = rank - scenario.train
    options = RefitOptions(**{"bucket_bytes": 1024, "num_buffers": 2, **scenario.options, "timeout_s": 90})
    engine = ToyEngine(local, scenario.gen)
    receiver = RefitReceiver(engine, rendezvous=address, rank=local, world_size=scenario.gen, options=options)
    receiver.setup()
    receiver.receive()
    result = {"recovered": _state_against(engine, receiver, 5), "recovered_version": receiver.version}
    receiver.close()
    return result


def _state_against(engine: ToyEngine, receiver: RefitReceiver, step: int) -> bool:
    from refit_core.kit.verify import mismatches
    return not mismatches(receiver.plugins.destination_map(engine).pieces, reference(0, step))


def _serves(engine: ToyEngine) -> bool:
    try:
        engine.serve()
    except RuntimeError:
        return False
    return True


def setup_rank(rank: int, report, address: str, train: int, gen: int, options: dict, steps: int = 1,
               base: int = 0) -> dict:
    """Set up (and refit ``steps`` times) toy rank ``rank - base``; setup errors are returned, not raised."""
    rank -= base
    is_train = rank < train
    local, size = (rank, train) if is_train else (rank - train, gen)
    model = ToyTrainer(local, size) if is_train else ToyEngine(local, size)
    cls = RefitSender if is_train else RefitReceiver
    start = time.monotonic()
    try:
        endpoint = cls(model, rendezvous=address, rank=local, world_size=size,
                       options=RefitOptions(**{"timeout_s": 30, **options}))
        endpoint.setup()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    bitwise = True
    for step in range(steps):
        if is_train:
            model.load(reference(0, step))
            endpoint.send(version=step)
        else:
            endpoint.receive()
            bitwise &= _state_against(model, endpoint, step)
    endpoint.close()
    return {"ok": True, "bitwise": bitwise, "seconds": time.monotonic() - start}


def exit_during_setup_rank(rank: int, report, address: str, train: int, gen: int, options: dict) -> dict:
    """A gen rank that joins the rendezvous and dies (os._exit) before publishing its metadata."""
    from refit_core.contract.env import with_overrides
    from refit_core.net.auth import JobCredentials
    from refit_core.net.rendezvous import Rendezvous

    credentials = JobCredentials.required(with_overrides(RefitOptions(**options)), f"gen rank {rank - train}")
    Rendezvous(address, host=False, who=f"gen/{rank - train}", timeout_s=30, credentials=credentials)
    time.sleep(1)
    os._exit(3)


def transport_fails_rank(rank: int, report, address: str, train: int, gen: int, options: dict) -> dict:
    """A rank whose transport cannot open (gloo's constructor raising, injected): the others must
    hear of it at once instead of waiting for gloo's timeout."""
    import refit_core.endpoints.setup as endpoint

    def broken(*args, **kwargs):
        raise RuntimeError("injected: gloo could not create its context on this rank")
    endpoint.open_transport = broken
    return setup_rank(rank, report, address, train, gen, options)


def tampered_plan_rank(rank: int, report, address: str, train: int, gen: int, options: dict) -> dict:
    """A rank whose part of the plan, as it reads it, names another dtype for its first piece (as if
    the planner had planned for other pieces than this rank has): its check must fail the setup on
    every rank before any collective, naming the tensor."""
    import refit_core.endpoints.setup as endpoint
    import refit_core.plan.rankplan as rankplan

    real = rankplan.from_wire

    def tampered(value, side, local):
        plan = real(value, side, local)
        index, meta = next(iter(plan.pieces.items()))
        spec = dataclasses.replace(meta.spec, dtype=torch.float16)
        return dataclasses.replace(plan, pieces={**plan.pieces, index: dataclasses.replace(meta, spec=spec)})

    def no_collective(*args, **kwargs):
        raise AssertionError("the transport opened although the plan was refused")

    rankplan.from_wire = tampered
    endpoint.open_transport = no_collective
    return setup_rank(rank, report, address, train, gen, options)


def planner_dies_rank(rank: int, report, address: str, train: int, gen: int, options: dict) -> dict:
    """Train rank 0 (the planner, hosting the store) dying (os._exit) while it plans."""
    import refit_core.endpoints.agreement as agreement

    def dies(*args, **kwargs):
        os._exit(3)
    agreement.plan_with_relay = dies
    return setup_rank(rank, report, address, train, gen, options)
