"""A fleet (:mod:`refit_core.fleet`) driven from one Ray controller: :class:`RayFleet`, the sibling of
:class:`~refit_core.kit.ray.RayRefit` for replicas that join, die and restart.

    Trainer = ray.remote(fleet_train_actor(FSDPPolicyActor))   # any RefitTrainActor class
    fleet = RayFleet(trainers)                                 # once: train rank 0 hosts the fleet's store
    fleet.open()
    joined = engine.refit_join_fleet.remote(fleet.address, "r0", fleet.options, 600.0)   # a replica's actor
    fleet.await_joins(1)                                       # its request is in: the next step admits it
    for step in range(steps):
        ...                                                    # train; every replica in: refit_fleet_receive()
        print(fleet.send(version=step).landed)                 # the replicas that hold the version now

A replica's engine actor joins with ``refit_join_fleet(fleet, replica, options, join_timeout_s)``, which returns
the version of the step that admitted it once that step landed, whole, and receives every later step with
``refit_fleet_receive()`` (e.g. ``refit_vllm.ray.VLLMEngineActor``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray

from refit_core.contract.errors import RefitError
from refit_core.contract.options import RefitOptions
from refit_core.fleet.records import FleetStep
from refit_core.fleet.status import read_fleet
from refit_core.fleet.trainer import RefitFleet
from refit_core.kit.ray import RefitTrainActor, gather, job_options

JOIN_POLL_S = 0.2
"""How often :meth:`RayFleet.await_joins` reads the fleet's join counter."""


class RefitFleetTrainActor(RefitTrainActor):
    """Mixed into a train actor class (:func:`fleet_train_actor`): it also feeds a fleet, with one
    :class:`~refit_core.fleet.trainer.RefitFleet` over :meth:`refit_model` for the whole run."""

    _refit_fleet: RefitFleet | None = None

    def refit_fleet_open(self, address: str, rank: int, world_size: int, options: RefitOptions) -> None:
        """Open the fleet as train rank ``rank`` of ``world_size`` (train rank 0 hosts its store at ``address``)."""
        self.refit_fleet_close()
        fleet = RefitFleet(self.refit_model(), rendezvous=address, rank=rank, world_size=world_size, options=options)
        fleet.open()
        self._refit_fleet = fleet

    def refit_fleet_send(self, version: int) -> FleetStep:
        """One fleet step: send the model's weights as ``version`` to every replica in the fleet now."""
        if self._refit_fleet is None:
            raise RefitError("refit_fleet_open() was not called on this train actor")
        return self._refit_fleet.send(version)

    def refit_fleet_close(self) -> None:
        if self._refit_fleet is not None:
            self._refit_fleet.close()
        self._refit_fleet = None


def fleet_train_actor(train_actor: type) -> type:
    """``train_actor`` (a :class:`RefitTrainActor` class) with :class:`RefitFleetTrainActor`'s methods mixed in."""
    if issubclass(train_actor, RefitFleetTrainActor):
        return train_actor
    return type(f"Fleet{train_actor.__name__}", (RefitFleetTrainActor, train_actor), {"__module__": __name__})


class RayFleet:
    """The trainers' side of a fleet, driven from the controller.

    ``trainers``: one actor of a :func:`fleet_train_actor` class per train rank, in rank order. Every blocking
    call fails after ``timeout_s`` naming the actors that did not answer. Without a secret in ``options`` a fresh
    random one is made here: hand :attr:`options` to the replicas' actors (over Ray), which join with it.
    """

    def __init__(self, trainers: Sequence[Any], *, options: RefitOptions | None = None, timeout_s: float = 300.0,
                 train_names: Sequence[str] | None = None) -> None:
        if not trainers:
            raise RefitError("a fleet needs at least one train actor")
        self.trainers = list(trainers)
        self.options = job_options(options, timeout_s)
        self.timeout_s = timeout_s
        self.train_names = list(train_names or (f"train actor {i}" for i in range(len(trainers))))
        self.address: str | None = None

    def open(self, address: str | None = None) -> str:
        """Open the fleet on every train actor at ``address`` (None: train rank 0's node, a free port); returns
        the address the replicas join."""
        if address is None:
            (address,) = gather({self.trainers[0].refit_address.remote(): self.train_names[0]},
                                "picking the fleet's address", self.timeout_s)
        gather({t.refit_fleet_open.remote(address, i, len(self.trainers), self.options): name
                for i, (t, name) in enumerate(zip(self.trainers, self.train_names))}, "opening the fleet",
               self.timeout_s)
        self.address = address
        return address

    def send(self, version: int) -> FleetStep:
        """One step on every train actor; train rank 0's :class:`FleetStep` (every train rank must agree on which
        replicas landed, or this raises)."""
        steps: list[FleetStep] = gather({t.refit_fleet_send.remote(version): n for t, n in
                                         zip(self.trainers, self.train_names)}, f"fleet step of version {version}",
                                        self.timeout_s)
        differ = [n for s, n in zip(steps, self.train_names) if s.landed != steps[0].landed]
        if differ:
            raise RefitError(f"fleet step of version {version}: {', '.join(differ)} saw other replicas land than "
                             f"{self.train_names[0]} ({list(steps[0].landed)})")
        return steps[0]

    def await_joins(self, requests: int, timeout_s: float | None = None) -> None:
        """Wait until the fleet holds ``requests`` join requests in all, counted since it opened (each rank of a
        joining replica makes one): the next :meth:`send` admits every replica whose ranks all asked."""
        if self.address is None:
            raise RefitError("call RayFleet.open() before await_joins()")
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while (seen := read_fleet(self.address, self.options).join_requests) < requests:
            if time.monotonic() > deadline:
                raise RefitError(f"the fleet at {self.address} holds {seen} join request(s) after {limit:.0f} s, "
                                 f"{requests} expected: a replica's actor never asked to join")
            time.sleep(JOIN_POLL_S)

    def close(self) -> None:
        """Close every train actor's fleet (train rank 0 last: it hosts the store; best effort, a dead actor is
        skipped)."""
        refs = [t.refit_fleet_close.remote() for t in self.trainers[1:]]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        ray.wait([self.trainers[0].refit_fleet_close.remote()], timeout=self.timeout_s)
        self.address = None


__all__ = ["RayFleet", "RefitFleetTrainActor", "fleet_train_actor"]
