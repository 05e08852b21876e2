"""Drive a refit from one Ray controller: train actors -> engine actors, in a few lines.

    from refit_core.kit import RayRefit

    refit = RayRefit(trainers, engines)   # Ray actor handles
    refit.setup()                         # rendezvous on train rank 0's node, both sides at once
    for step in range(steps):
        ...                               # train
        refit.sync(version=step)          # every trainer sends, every engine receives

Actors speak a small protocol of plain methods, so any actor class can join:

- a **train actor** (one per train rank) subclasses :class:`RefitTrainActor` and implements
  ``refit_model()`` (its live, sharded model);
- a **gen actor** holds one or more gen ranks: :class:`RefitReceiveActor` (one rank, e.g. a DTensor
  policy copy; implement ``refit_model()``), or an engine actor from a gen plugin that holds a whole
  engine, such as ``refit_vllm.ray.VLLMEngineActor`` (vLLM through its own weight-transfer API).

Errors raised inside any actor surface in the controller as :class:`~refit_core.contract.errors.RefitError`
naming the actor; a call that outlives ``timeout_s`` names the actors that did not answer. Ray is an
optional dependency (``pip install refit-core[ray]``): importing this module needs it, the core does not.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from refit_core.contract.errors import RefitError
from refit_core.contract.options import RefitOptions
from refit_core.endpoints.receiver import RefitReceiver
from refit_core.endpoints.sender import RefitSender
from refit_core.net.auth import new_secret


@dataclass(frozen=True)
class SyncReport:
    """One :meth:`RayRefit.sync`: the version, its wall time in the controller, and bytes moved."""

    version: int
    seconds: float
    bytes: int


class RefitActor:
    """What train and gen actors share: the model they hold and a free address on their node."""

    def refit_model(self) -> Any:
        """The live model this actor refits from or into (e.g. an FSDP2 module)."""
        raise NotImplementedError(f"{type(self).__name__} must implement refit_model()")

    def refit_address(self) -> str:
        """``ip:port`` on this actor's node with a port free right now (a rendezvous, a process group)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((ip, 0))
            return f"{ip}:{sock.getsockname()[1]}"


class RefitTrainActor(RefitActor):
    """Mix into a Ray actor class that holds one train rank; implement :meth:`refit_model`."""

    _refit_sender: RefitSender | None = None

    def refit_setup(self, rendezvous: str, rank: int, world_size: int, options: RefitOptions) -> str:
        """Join the refit as train rank ``rank``; returns the plan's fingerprint (the gen-actor protocol's
        ``refit_setup`` may return None instead)."""
        self.refit_close()
        self._refit_sender = RefitSender(self.refit_model(), rendezvous=rendezvous, rank=rank,
                                         world_size=world_size, options=options)
        return self._refit_sender.setup().fingerprint

    def refit_send(self, version: int) -> int:
        """Send the model's current weights as ``version``; returns the bytes this rank sent."""
        if self._refit_sender is None:
            raise RefitError("refit_setup() was not called on this train actor")
        return self._refit_sender.send(version).bytes

    def refit_close(self) -> None:
        if self._refit_sender is not None:
            self._refit_sender.close()
        self._refit_sender = None


class RefitReceiveActor(RefitActor):
    """Mix into a Ray actor class that holds one gen rank; implement :meth:`refit_model`."""

    _refit_receiver: RefitReceiver | None = None

    def refit_gen_ranks(self) -> int:
        """Gen ranks this actor holds: one."""
        return 1

    def refit_setup(self, rendezvous: str, rank_offset: int, world_size: int, options: RefitOptions) -> str:
        """Join the refit as gen rank ``rank_offset``; returns the plan's fingerprint."""
        self.refit_close()
        self._refit_receiver = RefitReceiver(self.refit_model(), rendezvous=rendezvous, rank=rank_offset,
                                             world_size=world_size, options=options)
        return self._refit_receiver.setup().fingerprint

    def refit_receive(self, version: int) -> int:
        """Receive one step; raises if the train side sent another version. Returns bytes received."""
        if self._refit_receiver is None:
            raise RefitError("refit_setup() was not called on this gen actor")
        stats = self._refit_receiver.receive()
        if stats.version != version:
            raise RefitError(f"received weight version {stats.version}, the controller expected {version}")
        return stats.bytes

    def refit_close(self) -> None:
        if self._refit_receiver is not None:
            self._refit_receiver.close()
        self._refit_receiver = None


class RayRefit:
    """A refit between Ray actors, driven from the controller.

    ``trainers``: one actor per train rank, in rank order (:class:`RefitTrainActor` protocol).
    ``engines``: gen actors (:class:`RefitReceiveActor` protocol, or a plugin's engine actor holding
    several gen ranks); their gen ranks are numbered in the order given. ``names`` label actors in
    errors (default ``train actor i`` / ``engine actor j``). Every blocking call fails after
    ``timeout_s`` naming the actors that did not answer. Without a secret in ``options``, a fresh random
    one is made here and reaches every actor with the options (over Ray's own channel, never the
    rendezvous): no other process can join the refit.
    """

    def __init__(self, trainers: Sequence[Any], engines: Sequence[Any], *, options: RefitOptions | None = None,
                 timeout_s: float = 300.0, train_names: Sequence[str] | None = None,
                 engine_names: Sequence[str] | None = None) -> None:
        if not trainers or not engines:
            raise RefitError("a refit needs at least one train actor and one engine actor")
        self.trainers = list(trainers)
        self.engines = list(engines)
        self.options = job_options(options, timeout_s)
        self.timeout_s = timeout_s
        self.train_names = list(train_names or (f"train actor {i}" for i in range(len(trainers))))
        self.engine_names = list(engine_names or (f"engine actor {j}" for j in range(len(engines))))
        self.rendezvous: str | None = None
        self.fingerprint: str | None = None
        self.setup_seconds = 0.0

    def setup(self, rendezvous: str | None = None) -> str:
        """Pick the rendezvous (train rank 0's node, a free port) unless given, then set up both sides
        concurrently; returns the plan's fingerprint, agreed by every rank."""
        start = time.perf_counter()
        if rendezvous is None:
            (rendezvous,) = gather({self.trainers[0].refit_address.remote(): self.train_names[0]},
                                   "picking the rendezvous", self.timeout_s)
        ranks = gather({e.refit_gen_ranks.remote(): n for e, n in zip(self.engines, self.engine_names)},
                       "counting gen ranks", self.timeout_s)
        offsets = [sum(ranks[:j]) for j in range(len(ranks))]
        calls = {t.refit_setup.remote(rendezvous, i, len(self.trainers), self.options): name
                 for i, (t, name) in enumerate(zip(self.trainers, self.train_names))}
        calls.update({e.refit_setup.remote(rendezvous, offset, sum(ranks), self.options): name
                      for e, offset, name in zip(self.engines, offsets, self.engine_names)})
        # engine actors may not report a fingerprint (None); the core checks agreement across all ranks
        fingerprints = {fp for fp in gather(calls, "refit setup", self.timeout_s) if fp is not None}
        if len(fingerprints) != 1:
            raise RefitError(f"actors agreed on different plans: {sorted(fingerprints)}")
        self.rendezvous, self.fingerprint = rendezvous, fingerprints.pop()
        self.setup_seconds = time.perf_counter() - start
        return self.fingerprint

    def sync(self, version: int) -> SyncReport:
        """One refit step: every train actor sends ``version`` while every engine receives it."""
        if self.fingerprint is None:
            raise RefitError("call RayRefit.setup() before sync()")
        start = time.perf_counter()
        calls = {t.refit_send.remote(version): n for t, n in zip(self.trainers, self.train_names)}
        engine_calls = {e.refit_receive.remote(version): n for e, n in zip(self.engines, self.engine_names)}
        results = gather({**calls, **engine_calls}, f"refit of version {version}", self.timeout_s)
        sent = sum(results[:len(calls)])
        return SyncReport(version, time.perf_counter() - start, sent)

    def close(self) -> None:
        """Close every actor's endpoint (best effort: a dead actor is skipped)."""
        refs = [a.refit_close.remote() for a in (*self.trainers, *self.engines)]
        ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        self.fingerprint = None


def job_options(options: RefitOptions | None, timeout_s: float) -> RefitOptions:
    """``options`` (None: ``RefitOptions(timeout_s=timeout_s)``) with a fresh random secret unless they carry
    one: it reaches the actors over Ray's own channel, never the rendezvous, so no other process can join."""
    options = options or RefitOptions(timeout_s=timeout_s)
    if options.secret is None:
        options = options.overridden({"secret": new_secret()}, explicit=False)
    return options


def gather(calls: dict[Any, str], what: str, timeout_s: float) -> list[Any]:
    """Results of ``calls`` (Ray object ref -> the actor's name), in order.

    The first failure is raised at once as :class:`RefitError` naming its actor; past ``timeout_s``
    the error names every actor that has not answered.
    """
    order = list(calls)
    pending = list(order)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = ", ".join(calls[r] for r in pending)
            raise RefitError(f"{what}: no answer within {timeout_s:.0f} s from {late}")
        try:
            ray.get(ready[0])
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
            raise RefitError(f"{what} failed on {calls[ready[0]]}: {_cause(exc)}") from exc
    return ray.get(order)


def _cause(exc: Exception) -> str:
    """The actor-side exception's own message (Ray wraps it with a traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return str(exc).strip().splitlines()[-1]


__all__ = ["RayRefit", "RefitActor", "RefitReceiveActor", "RefitTrainActor", "SyncReport", "gather", "job_options"]
