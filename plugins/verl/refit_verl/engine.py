"""refit as verl's ``refit`` checkpoint engine (``CheckpointEngineRegistry``), imported by verl through
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=refit_verl.engine``.

verl's ``CheckpointEngineManager.update_weights`` runs, every step: ``prepare`` and ``build_topology`` (the
rendezvous: actor rank 0's address), ``init_process_group`` on every actor and rollout worker, then
``send_weights`` / ``receive_weights`` together, then ``finalize``. Here ``init_process_group`` sets up a
:class:`~refit_core.RefitSender` on the actor's training engine and a :class:`~refit_core.RefitReceiver`
on the rollout's model once (refit plans once); every step moves each rank's own FSDP2 or Megatron shards
straight into the rollout's parameters as weight version ``global_steps``. ``send_weights`` never iterates
the generator verl hands it: verl's generators (FSDP2's ``full_tensor()``, Megatron's all-gather per
tensor-parallel weight) gather only when iterated, so nothing is gathered. ``receive_weights`` yields
nothing: the weights are already in place.

Offload: refit refuses a source whose memory moved since setup (a colocated engine reads it in place).
With the actor's ``param_offload``, ``init_process_group`` loads the parameters to the device and sets up
against them, and ``finalize`` offloads them again and closes: every step is planned where the
parameters are. Engine kwargs (``engine_kwargs.refit``): ``host`` (the address ranks reach actor rank 0
on; default: Ray's node address) and any :class:`~refit_core.RefitOptions` field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import secrets
import socket
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from refit_core import PluginError, RefitError, RefitOptions, RefitReceiver, RefitSender

from . import BACKEND
from .sources import rollout_model, training_engine, worker_holding


class Role(StrEnum):
    """Which end of the weight sync a worker's engine is."""

    ACTOR = "actor"
    ROLLOUT = "rollout"


@dataclass(frozen=True)
class Topology:
    """One worker's place in a sync: its end, rank among that end's workers, that end's size, the rendezvous."""

    role: Role
    rank: int
    world_size: int
    rendezvous: str

    def same_ranks(self, other: Topology | None) -> bool:
        """Whether ``other`` puts this worker at the same place (the rendezvous may differ: a fresh port)."""
        return other is not None and (self.role, self.rank, self.world_size) == (other.role, other.rank,
                                                                                 other.world_size)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


@CheckpointEngineRegistry.register(BACKEND)
class RefitCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine ``refit``: see the module docstring. ``bucket_size`` is unused (refit sizes
    its own messages); ``is_master`` is verl's, and so unused too (actor rank 0 hosts the rendezvous)."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, host: str | None = None,
                 **options: Any) -> None:
        self.options = RefitOptions(**options)
        self.host = host
        self.model: Any = None
        """Bound with :meth:`bind`, else found on the verl worker holding this engine."""
        self.topology: Topology | None = None
        self.endpoint: RefitSender | RefitReceiver | None = None
        self.setups = 0
        """How many times this engine set up refit (once, unless offload, a failed step or a new topology)."""
        self.version = -1
        """The last version moved (``global_steps``, or a count when verl gives none)."""
        self._offloaded: Any = None
        """The training engine whose parameters ``finalize`` offloads again (None: no offload)."""
        self._receiving: concurrent.futures.Future[Any] | None = None

    def bind(self, model: Any) -> None:
        """Move ``model``'s weights (actor) or into ``model`` (rollout), where no verl worker holds this engine."""
        self.model = model

    def prepare(self) -> dict[str, Any]:
        """This worker's proposal for the rendezvous and the job's secret; actor rank 0's are used. The secret
        travels to the other workers through verl's controller (Ray), never through the rendezvous."""
        offload = self.model is None and getattr(self._source(), "is_param_offload_enabled", False)
        return {"host": self.host or _node_address(), "port": _free_port(), "secret": secrets.token_hex(16),
                "fresh": bool(offload)}

    def _source(self) -> Any:
        """The actor's training engine, where this engine belongs to an actor worker (else None)."""
        try:
            return training_engine(worker_holding(self))
        except PluginError:
            return None

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor and rollout workers each a refit side of their own size, meeting at actor rank 0's address."""
        rendezvous = f"{metadata[0]['host']}:{metadata[0]['port']}"
        secret = metadata[0]["secret"]
        fresh = any(m.get("fresh", False) for m in metadata)  # an offloaded actor: plan this step anew

        def side(role: Role, size: int) -> dict[str, list[Any]]:
            return {"role": [role.value] * size, "rank": list(range(size)), "world_size": [size] * size,
                    "rendezvous": [rendezvous] * size, "secret": [secret] * size, "fresh": [fresh] * size}

        return side(Role.ACTOR, actor_wg_world_size), side(Role.ROLLOUT, rollout_world_size)

    def init_process_group(self, role: str, rank: int, world_size: int, rendezvous: str, secret: str,
                           fresh: bool = False) -> None:
        """Set up refit's sender or receiver (a collective of both ends), or keep the one set up before
        (``fresh``: set up anew, the actor's parameters were offloaded). ``secret`` is the job's (actor rank
        0's) unless the options or ``REFIT_SECRET`` give one."""
        topology = Topology(Role(role), rank, world_size, rendezvous)
        if self.endpoint is not None and topology.same_ranks(self.topology) and not fresh:
            return
        self.close()
        options = self.options if self.options.secret or os.environ.get("REFIT_SECRET") else \
            dataclasses.replace(self.options, secret=secret)
        model = self.model if self.model is not None else self._worker_model(topology.role)
        if topology.role is Role.ACTOR:
            if getattr(model, "is_param_offload_enabled", False):
                from verl.utils.device import get_device_name

                model.to(get_device_name(), model=True, optimizer=False, grad=False)
                self._offloaded = model
            endpoint: RefitSender | RefitReceiver = RefitSender(
                model, rendezvous=rendezvous, rank=rank, world_size=world_size, options=options)
        else:
            endpoint = RefitReceiver(model, rendezvous=rendezvous, rank=rank, world_size=world_size, options=options)
        endpoint.setup()
        self.endpoint, self.topology = endpoint, topology
        self.setups += 1

    def _worker_model(self, role: Role) -> Any:
        worker = worker_holding(self)
        return training_engine(worker) if role is Role.ACTOR else rollout_model(worker)

    def _next_version(self, global_steps: int | None) -> int:
        return self.version + 1 if global_steps is None else global_steps

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None] | Any,
                           global_steps: int | None = None) -> dict[str, float]:
        """Move this actor rank's shards as version ``global_steps``; ``weights`` is closed unread."""
        close = getattr(weights, "close", None)
        if close is not None:
            close()
        sender = self._require(RefitSender)
        version = self._next_version(global_steps)
        try:
            stats = await asyncio.to_thread(sender.send, version=version)
        except Exception:
            self.close()  # a failed step: the next sync sets up anew (refit's rule after a TransferError)
            raise
        self.version = version
        return {"refit/sent_bytes": float(stats.staging_bytes + stats.direct_bytes)}

    def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Receive version ``global_steps`` into the rollout's parameters (it starts at once, on a thread); the
        generator returned yields nothing, once the step landed."""
        receiver = self._require(RefitReceiver)
        version = self._next_version(global_steps)
        self._receiving = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-receive") \
            .submit(receiver.receive)
        return self._landed(self._receiving, version)

    async def _landed(self, receiving: concurrent.futures.Future[Any],
                      version: int) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        try:
            stats = await asyncio.wrap_future(receiving)
        except Exception:
            self.close()
            raise
        if stats.version != version:
            raise RefitError(f"refit checkpoint engine: received weight version {stats.version}, verl's global_steps "
                             f"is {version}")
        self.version = version
        return
        yield  # an async generator that yields nothing: the weights are in the rollout's parameters

    def finalize(self) -> None:
        """Keep the session for the next step, unless the actor's parameters are offloaded again."""
        if self._offloaded is not None:
            self._offloaded.to("cpu", model=True, optimizer=False, grad=False)
            self.close()

    def close(self) -> None:
        """Close refit's endpoint; the next ``init_process_group`` sets up anew."""
        if self.endpoint is not None:
            self.endpoint.close()
        self.endpoint, self.topology, self._offloaded = None, None, None

    def _require(self, kind: type[Any]) -> Any:
        if not isinstance(self.endpoint, kind):
            raise RefitError(f"refit checkpoint engine: no {kind.__name__} set up on this worker "
                             "(verl calls init_process_group before every sync)")
        return self.endpoint
