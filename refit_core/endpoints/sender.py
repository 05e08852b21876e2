"""The train side of a refit: a :class:`RefitSender` on every train rank sends the model's weights every step."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from refit_core.contract.errors import RefitError, TransferError
from refit_core.contract.options import RefitOptions, UpdateMode
from refit_core.contract.pieces import Piece
from refit_core.contract.plugins import PluginManager
from refit_core.contract.side import Side
from refit_core.contract.spec import Box, TensorSpec
from refit_core.endpoints import landing
from refit_core.endpoints.base import RefitEndpoint, by_peer, combined_stats, split_rounds
from refit_core.plan.schedule import Schedule
from refit_core.run.colocated import ColocatedSender
from refit_core.run.executor import SendExecutor, StepStats
from refit_core.units import format_bytes

log = logging.getLogger("refit")


SourceAddress = tuple[TensorSpec, Box, int]
"""What a colocated engine relies on of one source piece: its tensor, its box and its address (0: no view).

A plain tuple, not a record: the signature is built and compared before every colocated step, on its
critical path (a frozen dataclass per piece cost 1.2 ms a step at the Llama-3-8B shape on an H200)."""


def source_signature(pieces: Sequence[Piece]) -> list[SourceAddress]:
    """Per source piece, its :data:`SourceAddress`."""
    return [(p.spec, p.box, p.view.data_ptr() if p.view is not None else 0) for p in pieces]


class RefitSender(RefitEndpoint):
    """The train side of a refit, one per train rank. ``send(version)`` every step."""

    side = Side.TRAIN

    def __init__(self, model: Any, *, rendezvous: str, rank: int, world_size: int,
                 options: RefitOptions | None = None, plugins: PluginManager | None = None,
                 host_id: str | None = None) -> None:
        super().__init__(model, rendezvous=rendezvous, rank=rank, world_size=world_size, options=options,
                         plugins=plugins, host_id=host_id)
        self._signature: list[SourceAddress] | None = None
        """The source pieces bound at setup (None before one succeeded)."""

    def _local_pieces(self) -> list[Piece]:
        pieces: list[Piece] = list(self.plugins.source_pieces(self.model))
        missing = [p.spec.name for p in pieces if p.view is None]
        if missing:
            raise RefitError(f"source pieces without views: {missing[:5]}")
        return pieces

    def _make_executors(self, schedule: Schedule, settings: RefitOptions) -> None:
        network, colocated = split_rounds(schedule.rounds_of_source(self.rank), self._is_network)
        if network:
            assert self.transport is not None
            self._executor = SendExecutor(network, self.transport, self.sizes[Side.TRAIN],
                                          **self._network_executor_args(schedule, settings))
        if colocated:
            self._colocated = ColocatedSender(by_peer(colocated, lambda m: m.dst), self._require_rendezvous().store,
                                              self.rank, self.device, schedule.fingerprint, settings.timeout_s,
                                              trace=settings.step_trace)

    def setup(self) -> Schedule:
        schedule = super().setup()
        self._bind(self._pieces)
        self._signature = source_signature(self._pieces)
        return schedule

    def _moved_sources(self, colocated: ColocatedSender) -> str | None:
        """What the trainer freed, replaced or moved since setup (colocated engines read it in place).

        Runs before every colocated step, on its critical path: the common case (nothing changed) is
        one comparison of (spec, box, address) per piece; only a difference is diagnosed in detail."""
        problem = colocated.check()
        if problem is not None:
            return problem
        current = self._local_pieces()
        if source_signature(current) == self._signature:
            return None
        if [p.meta for p in current] != [p.meta for p in self._pieces]:
            return "the trainer's source pieces changed since setup(); call setup() again after changing the model"
        for now, bound in zip(current, self._pieces):
            assert now.view is not None and bound.view is not None
            if (now.view.data_ptr() != bound.view.data_ptr()
                    or now.view.untyped_storage().data_ptr() != bound.view.untyped_storage().data_ptr()):
                return (f"source tensor {now.spec.name}{now.box} now lives at a different address than at "
                        "setup (the trainer replaced or moved the parameter; a colocated engine reads it in "
                        "place: update parameters in place between setup() and close())")
        return None

    def send(self, version: int) -> StepStats:
        """Send the model's current weights as weight ``version``; returns this rank's step stats.

        With colocated peers this first checks that every source tensor is still the memory shared at
        setup; if not, the step fails on this rank and on its colocated peers, naming the tensor.
        In staged mode it returns once every gen rank has landed the step. After a failure
        (:class:`~refit_core.contract.errors.TransferError`), ``close()`` and ``setup()`` again.
        """
        self._require_step()
        step, self._steps = self._steps, self._steps + 1
        start = time.perf_counter()
        colocated = self._colocated
        executor = self._executor
        assert executor is None or isinstance(executor, SendExecutor)
        try:
            if isinstance(colocated, ColocatedSender):
                colocated.mark("start")
                if self.settings is not None and self.settings.overlap_check:  # the engine copies meanwhile
                    colocated.post(version, verdict=True)
                    problem = self._moved_sources(colocated)
                    colocated.post_verdict(problem)
                else:
                    problem = self._moved_sources(colocated)
                    colocated.post(version, problem)
                if problem is not None:
                    raise TransferError(f"train rank {self.rank}: {problem}")
            stats = executor.run(version) if executor is not None else None
            if isinstance(colocated, ColocatedSender):
                colocated.wait()
            stats = combined_stats(stats, version, colocated, start)
            if self._mode is UpdateMode.STAGED:
                landing.await_landing(self._require_rendezvous(), step, self.sizes[Side.GEN])
            if isinstance(colocated, ColocatedSender):
                colocated.mark("end")
        except Exception as exc:
            self._break(str(exc))
            if isinstance(exc, RefitError):
                raise
            raise TransferError(f"refit step {step} failed on train rank {self.rank}: {exc}") from exc
        log.info("refit sent version %d: %s in %.3f s (%.2f GB/s)", version, format_bytes(stats.bytes),
                 stats.seconds, stats.gbps)
        return stats


__all__ = ["RefitSender"]
