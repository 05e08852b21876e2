"""The train side of a refit: a :class:`RefitSender` on every train rank sends the model's weights every step."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from refit_core.contract.errors import PlanError, RefitError, RendezvousError, TransferError
from refit_core.contract.lora import AdapterFactors, LoraFactors, LoraMerge, MergedSourcePiece
from refit_core.contract.options import RefitOptions, UpdateMode
from refit_core.contract.pieces import Piece
from refit_core.contract.plugins import PluginManager
from refit_core.contract.side import Side
from refit_core.endpoints import adapters, commit
from refit_core.endpoints.base import RefitEndpoint
from refit_core.endpoints.versions import checked_version
from refit_core.endpoints.wiring import by_peer, colocated_path, combined_stats, executor_settings, split_rounds
from refit_core.plan.planning import PlanCache
from refit_core.plan.items import Message
from refit_core.plan.links import Link
from refit_core.plan.schedule import Schedule
from refit_core.run.colocated import ColocatedSender
from refit_core.run.executor import HeaderScope, Merging, SendExecutor, StepCount, StepStats
from refit_core.units import format_bytes

log = logging.getLogger("refit")


class RefitSender(RefitEndpoint):
    """The train side of a refit, one per train rank. ``send(version)`` every step.

    ``plan_cache``: train rank 0 keeps its plans there across setups with the same inputs (a
    :class:`~refit_core.plan.planning.PlanCache`, shared by a fleet's replica jobs; None: it plans every setup).
    """

    side = Side.TRAIN

    def __init__(self, model: Any, *, rendezvous: str, rank: int, world_size: int,
                 options: RefitOptions | None = None, plugins: PluginManager | None = None,
                 host_id: str | None = None, plan_cache: PlanCache | None = None) -> None:
        super().__init__(model, rendezvous=rendezvous, rank=rank, world_size=world_size, options=options,
                         plugins=plugins, host_id=host_id)
        self._plans = plan_cache
        self._decided = -1
        """The last step train rank 0 published a decision on."""
        self._heard_by = -1
        """Train rank 0: the step just committed, whose decision the other train ranks read before ``close()``
        stops the store (-1: none, or the last step failed)."""
        self._merging = Merging()
        """Merged mode: per bound source piece, the adapter folded into it when packed, and its box's origin."""
        self._adapters: list[AdapterFactors] = []
        """Merged mode: where this rank's merged pieces get their adapters each step (empty: none merged)."""
        self._gathered = -1
        """Merged mode: the last step this rank arrived at the adapters' gather of."""
        self.version: int | None = None
        """The weight version of the last step this sender sent successfully (None: none yet); kept across
        ``close()`` and ``setup()``: the next version must be greater (:mod:`refit_core.endpoints.versions`)."""

    def _local_pieces(self) -> list[Piece]:
        pieces: list[Piece] = list(self.plugins.source_pieces(self.model))
        missing = [p.spec.name for p in pieces if p.view is None]
        if missing:
            raise RefitError(f"source pieces without views: {missing[:5]}")
        return pieces

    def _make_executors(self, schedule: Schedule, settings: RefitOptions, scope: HeaderScope) -> None:
        merges = _merges(self._pieces)
        self._merging = Merging(merges, [p.box.offsets for p in self._pieces])
        self._adapters = list({id(m.factors): m.factors for m in merges if m is not None}.values())
        network, colocated = split_rounds(schedule.rounds_of_source(self.rank), self._is_network)
        if network and self.relay is not None and settings.relay.broadcast:  # headers to every group member
            size, replicas = self.relay.replica_size, self.relay.tree.replicas
            fed = {m.dst for msgs in network for m in msgs}
            scope = replace(scope, peers=tuple(sorted(p + r * size for p in fed for r in range(replicas))))
        if network:
            self._executor = self._network_executor(network, scope)
        if colocated:
            self._colocated = colocated_path().sender(by_peer(colocated, lambda m: m.dst),
                                                      self._require_rendezvous().store, self.rank, self.device,
                                                      schedule.fingerprint, settings.timeout_s,
                                                      trace=settings.step_trace)

    def _network_executor(self, rounds: list[list[Message]], scope: HeaderScope, steps: StepCount | None = None
                          ) -> SendExecutor:
        """A send executor for ``rounds``; in merged mode a subset's packs the same pieces as the whole one's."""
        assert self.transport is not None and self.schedule is not None and self.settings is not None
        return SendExecutor(rounds, self.transport, self.sizes[Side.TRAIN],
                            executor_settings(self.schedule, self.settings), scope=scope, steps=steps,
                            merging=self._merging)

    def setup(self) -> Schedule:
        self._decided = self._gathered = self._heard_by = -1
        schedule = super().setup()
        self._bind(self._pieces)
        return schedule

    def _moved_sources(self, colocated: ColocatedSender | None) -> str | None:
        """What the trainer freed, replaced or moved since setup: colocated engines read the memory shared
        at setup in place, and the network path sends from the views bound at setup (:meth:`_memory_problem`)."""
        problem = colocated.check() if colocated is not None else None
        return problem if problem is not None else self._memory_problem()

    def _check_plan(self, schedule: Schedule, links: dict[tuple[int, int], Link], pieces: list[Piece]) -> None:
        """Merged-mode LoRA is computed in the network pack step: a merged piece must not be read in place by a
        colocated engine, nor quantized on the way."""
        merges = _merges(pieces)
        if not any(merges):
            return
        for msgs in schedule.rounds_of_source(self.rank):
            for m in msgs:
                for seg in m.src_segments:
                    merge = merges[seg.piece]
                    if merge is None:
                        continue
                    if links[(m.src, m.dst)] is not Link.NETWORK:
                        raise PlanError(f"{merge.module}: merged-mode LoRA needs network pairs, but gen rank {m.dst} "
                                        f"would read train rank {self.rank}'s weights in place (colocated); put "
                                        "the engine on other devices (colocate='auto' on CPU), or move the "
                                        "adapters (adapter mode)")
                    if seg.scales is not None:
                        raise PlanError(f"{merge.module}: merged-mode LoRA into a quantized (FP8) destination is "
                                        "not supported; send merged weights unquantized, or the adapters")

    def _gather_adapters(self, step: int) -> Mapping[str, LoraFactors] | None:
        """Merged mode: this step's adapters (a collective over the trainer's ranks where they are
        sharded: every train rank runs it, in the same order, once every train rank arrived at it:
        :mod:`refit_core.endpoints.adapters`); None when nothing is merged."""
        if not self._adapters:
            return None
        adapters.arrive(self._require_rendezvous(), step, self.rank, self.world_size, self.options.timeout_s)
        self._gathered = step
        factors: dict[str, LoraFactors] = {}
        for factory in self._adapters:
            factors.update(factory.gather())
        return factors

    @property
    def _confirms(self) -> bool:
        """Whether this step ends with train rank 0's decision (staged mode always; in place with ``confirm``)."""
        assert self.settings is not None
        return self.settings.mode is UpdateMode.STAGED or self.settings.confirm

    def _confirm(self, step: int, version: int) -> None:
        """The step's commit point (:mod:`refit_core.endpoints.commit`): train rank 0 collects the gen ranks'
        votes and decides; in staged mode it returns once every gen rank that landed the step has read the
        decision and said what it did. Every other train rank reads the decision. Raises unless the step
        was committed everywhere."""
        rdv = self._require_rendezvous()
        timeout_s = self.options.timeout_s
        staged = self._mode is UpdateMode.STAGED
        if not self.plans:
            decision = commit.await_decision(rdv, step, timeout_s)
            commit.heard(rdv, step, self.rank)
        else:
            readers = staged or self.world_size > 1  # in place, only the other train ranks read it
            decision, votes = commit.decide(rdv, step, version, self.sizes[Side.GEN], timeout_s, readers=readers)
            self._decided = step
            if decision.verdict is commit.Verdict.COMMIT and self.world_size > 1:
                self._heard_by = step  # a failed step lingers for the failure notes instead (_failed)
            if staged:  # the ranks that landed the step must read the decision before this rank may exit
                landed = [v.rank for v in votes if v.landed]
                settled = commit.await_settlements(rdv, step, landed, timeout_s)
                if decision.verdict is commit.Verdict.COMMIT:
                    report = commit.unsettled_report(decision, landed, settled)
                    if report is not None:
                        raise TransferError(report)
        if decision.verdict is commit.Verdict.ABORT:
            outcome = ("no gen rank applied it (staged mode): the engine keeps its previous weights" if staged else
                       "in place, gen ranks that landed it hold the new weights and the others do not: the "
                       "engine must not serve until the next successful step")
            raise TransferError(f"step {step} (version {version}) failed: {decision.reason}; {outcome}")

    def _abort(self, step: int, version: int, reason: str) -> None:
        """Train rank 0 failed its own part of ``step``: publish the abort and, staged, let the gen ranks
        that landed it read it (best effort: the store may be gone)."""
        self._decided = step
        rdv = self._rdv
        if rdv is None:
            return
        try:
            commit.decide(rdv, step, version, self.sizes[Side.GEN], self.options.timeout_s, failure=reason)
            if self._mode is UpdateMode.STAGED:  # in place, gen ranks do not wait for the decision
                commit.drain(rdv, step, self.sizes[Side.GEN], self.options.timeout_s)
        except RefitError:
            pass

    def _step(self, step: int, version: int, only: Iterable[str] | None, start: float) -> StepStats:
        """Step ``step`` of ``send()``: check the sources, gather the adapters, move the bytes, commit."""
        colocated = self._colocated
        self._heard_by = -1
        _, executor = self._step_executor(only)
        assert executor is None or isinstance(executor, SendExecutor)
        if isinstance(colocated, ColocatedSender):
            colocated.mark("start")
            if self.settings is not None and self.settings.overlap_check:  # the engine copies meanwhile
                colocated.post(version, verdict=True)
                problem = self._moved_sources(colocated)
                colocated.post_verdict(problem)
            else:
                problem = self._moved_sources(colocated)
                colocated.post(version, problem)
        else:  # the network path reads the memory bound at setup: a replaced tensor would go stale
            problem = self._moved_sources(None)
        if problem is not None:
            raise TransferError(f"train rank {self.rank}: {problem}")
        factors = self._gather_adapters(step)
        stats = executor.run(version, factors=factors, timeline=self.timeline) if executor is not None else None
        if isinstance(colocated, ColocatedSender):
            colocated.wait()
        stats = combined_stats(stats, version, colocated, start)
        if self._confirms:
            self._confirm(step, version)
        if isinstance(colocated, ColocatedSender):
            colocated.mark("end")
        return stats

    def _failed(self, step: int, version: int, exc: Exception) -> Exception:
        """``step`` failed here: tell every other rank why (before the transport closes, so that the gen ranks'
        errors name it), break the transport, and on train rank 0 publish the abort and keep the store up
        while the others read the cause. The error to raise, naming the cause if another rank gave up first."""
        if self._adapters and self._gathered < step:  # train ranks waiting at the gather stop at once
            adapters.refuse(self._rdv, step, self.rank, str(exc))
        cause = commit.step_failed(self._rdv, step, self.me, self.sizes[Side.TRAIN], str(exc))
        self._break(str(exc))  # peers blocked on this rank's transfers fail now and vote
        if self._confirms and self.plans and self._decided < step:  # tell the gen ranks it failed here
            self._abort(step, version, f"train rank 0 failed: {exc}")
        if self.plans and self._rdv is not None:
            commit.linger(self._rdv, step, self.sizes, self.options.timeout_s)
        here = f"refit step {step} failed on train rank {self.rank}"
        if cause is not None and type(exc) not in _PLAIN and isinstance(exc, RefitError):
            exc.add_note(f"refit: {cause}")
            return exc
        if cause is None and isinstance(exc, RefitError):
            return exc
        error = TransferError(f"{here}: {exc}" if cause is None else f"{here}: {cause} (here: {exc})")
        error.__cause__ = exc
        return error

    def connected_gen_ranks(self) -> frozenset[int] | None:
        """Train rank 0 (the store's host): the gen ranks connected to this job's store now (one that died or
        closed is not); None on other train ranks, before ``setup()``, or when the store cannot tell."""
        if not self.plans or self._rdv is None:
            return None
        try:
            present = self._rdv.client.present(within=commit.CAUSE_READ_S)
        except RefitError:
            return None
        return frozenset(int(who.split("/")[1]) for who in present if who.startswith(f"{Side.GEN.value}/"))

    def close(self) -> None:
        """As :meth:`RefitEndpoint.close`; train rank 0 first waits (a few seconds at most) until every other
        train rank read its last decision, so that a trainer exiting after ``send()`` never takes the
        decision away from a slower train rank."""
        if self._heard_by >= 0 and self._rdv is not None:
            commit.await_hearers(self._rdv, self._heard_by, self.world_size, self.options.timeout_s)
            self._heard_by = -1
        super().close()

    def send(self, version: int, *, only: Iterable[str] | None = None, reset: bool = False) -> StepStats:
        """Send the model's current weights as weight ``version``; returns this rank's step stats.

        ``version`` is an integer from 0 to 2**63 - 1, greater than the last version this sender sent
        successfully (:attr:`version`, kept across ``close()`` and ``setup()``); ``reset=True`` starts a new
        sequence at any version in range (a trainer restored from a checkpoint: every train rank passes
        it). Any other version fails the step on every rank, naming it, before any byte moves.

        ``only`` names the tensors this step moves (None: every tensor of the plan): a subset, moved by a
        sub-schedule of the plan (:mod:`refit_core.plan.subset`); every train rank names the same ones and
        every gen rank the same in ``receive(only=...)``, else the step fails on both ends, naming the
        two subsets, before any byte moves. The engine's other tensors keep their bytes.

        It first checks that every source tensor is still the memory bound (shared with colocated
        peers) at setup; if not, the step fails, naming the tensor, before any byte moves. In staged
        mode it returns once every gen rank has read train rank 0's decision and applied the step; in
        place with ``confirm`` (off by default) once every gen rank said it landed it. A step that did not
        land everywhere raises :class:`~refit_core.contract.errors.TransferError` naming the ranks. After a failure
        (:class:`~refit_core.contract.errors.TransferError`), ``close()`` and ``setup()`` again.
        """
        self._require_step()
        step, self._steps = self._steps, self._steps + 1
        start = time.perf_counter()
        checked = checked_version(version, self.version, reset)
        try:
            if isinstance(checked, str):
                raise TransferError(f"train rank {self.rank} refuses step {step}: {checked}; nothing of the step moved")
            stats = self._step(step, checked, only, start)
        except Exception as exc:  # noqa: BLE001 - raised again, named; no local holds it (its traceback holds us)
            raise self._failed(step, -1 if isinstance(checked, str) else checked, exc)
        assert isinstance(checked, int)
        self.version = version = checked
        log.info("refit sent version %d: %s in %.3f s (%.2f GB/s)", version, format_bytes(stats.bytes),
                 stats.seconds, stats.gbps)
        return stats


_PLAIN = (RefitError, TransferError, RendezvousError)
"""Errors that say nothing by their type: a failed step's error wraps them with another rank's cause."""


def _merges(pieces: Sequence[Piece]) -> list[LoraMerge | None]:
    """Per piece, the LoRA adapter merged into it (merged mode), or None."""
    return [p.merge if isinstance(p, MergedSourcePiece) else None for p in pieces]


__all__ = ["RefitSender"]
