"""The gen side of a refit: a :class:`RefitReceiver` on every gen rank lands one weight version per ``receive()``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit_core.contract.errors import PlanError, RefitError, TransferError
from refit_core.contract.failures import StepFailedError, StepFailure
from refit_core.contract.options import RefitOptions, UpdateMode
from refit_core.contract.pieces import DestinationPiece, Piece
from refit_core.contract.plugins import PluginManager
from refit_core.contract.side import Side
from refit_core.contract.spec import TensorSpec
from refit_core.endpoints import commit
from refit_core.endpoints.base import RefitEndpoint
from refit_core.endpoints.wiring import by_peer, colocated_path, combined_stats, executor_settings, split_rounds
from refit_core.plan.items import Message
from refit_core.plan.relay import RelayPlan
from refit_core.plan.schedule import Schedule
from refit_core.run.colocated import ColocatedReceiver
from refit_core.run.executor import (
    ForwardExecutor,
    HeaderScope,
    ReceiveExecutor,
    SendExecutor,
    StepCount,
    StepStats,
)
from refit_core.run.quant.receiver import ReceiverQuantizer
from refit_core.units import format_bytes

log = logging.getLogger("refit")

TORN_NAMES_SHOWN = 6
"""How many torn destination tensors a failed step's error names."""


@dataclass
class _Ballot:
    """Where this step's commit stands on this rank: whether it voted, and the decision it read."""

    voted: bool = False
    decision: commit.Decision | None = None


class RefitReceiver(RefitEndpoint):
    """The gen side of a refit, one per gen rank. ``receive()`` every step lands one weight version."""

    side = Side.GEN

    def __init__(self, model: Any, *, rendezvous: str, rank: int, world_size: int,
                 options: RefitOptions | None = None, plugins: PluginManager | None = None,
                 host_id: str | None = None) -> None:
        super().__init__(model, rendezvous=rendezvous, rank=rank, world_size=world_size, options=options,
                         plugins=plugins, host_id=host_id)
        self.version: int | None = None
        """The weight version the engine holds (None: none from refit yet)."""
        self.last_failure: StepFailure | None = None
        """What the last step touched if it failed (None after a successful step)."""
        self._loader: list[TensorSpec] = []
        """The logical tensors of the loader path (received whole, handed to ``refit_load_weights``)."""
        self._quantizing = ReceiverQuantizer(())
        """This rank's receiver-side quantizations (set at setup from the schedule)."""

    def _local_pieces(self) -> list[Piece]:
        """The destination map's pieces, then one whole piece per loader tensor (recorded in ``_loader``)."""
        mapping = self.plugins.destination_map(self.model)
        self._loader = list(mapping.loader)
        loader: list[Piece] = [DestinationPiece(spec, spec.full_box()) for spec in self._loader]
        return [*mapping.pieces, *loader]

    def _make_executors(self, schedule: Schedule, settings: RefitOptions, scope: HeaderScope) -> None:
        self._quantizing = ReceiverQuantizer(schedule.receiver_quantizations_of(self.rank))
        network, colocated = split_rounds(schedule.rounds_of_destination(self.rank), self._is_network)
        relay = self.relay
        if network:
            forward_to = () if relay is None or relay.within_nodes else self._relay_children(relay)
            self._executor = self._network_executor(network, scope, forward_to=forward_to)
        if relay is not None:
            self._make_relay_executors(relay, schedule, settings, scope)
        if colocated:
            receiver = colocated_path().receiver(by_peer(colocated, lambda m: m.src),
                                                 self._require_rendezvous().store, self.rank, self.device,
                                                 schedule.fingerprint, settings.timeout_s,
                                                 strided=settings.strided_copies, trace=settings.step_trace)
            receiver.open()
            self._colocated = receiver

    def _make_relay_executors(self, relay: RelayPlan, schedule: Schedule, settings: RefitOptions,
                              scope: HeaderScope) -> None:
        """Replica relay: a relayed rank receives each round from its parent replica's rank and forwards it on
        to its own children (its network executor). Forwarding within nodes: after its own step landed, a
        rank sends the regions it leads to its node's other holders and receives the ones they lead, in one
        exchange per round (``_relay_out``)."""
        assert self.transport is not None  # always opened with relay
        offset = self.sizes[Side.TRAIN]  # relay peers are gen ranks: global rank = train ranks + gen rank
        run_with = executor_settings(schedule, settings)
        if relay.within_nodes:
            rounds = relay.schedule.rounds  # this rank's part: every round, both directions
            if any(rounds):
                self._relay_out = ForwardExecutor(self.rank, rounds, self.transport, offset, run_with)
            return
        incoming = relay.schedule.rounds_of_destination(self.rank)
        if incoming and self._executor is not None:
            raise PlanError(f"refit bug: gen rank {self.rank} is fed by trainers and by a relay")
        if incoming and settings.relay.broadcast:  # the first replica's messages, from the trainers, as it gets them
            self._executor = ReceiveExecutor(incoming, self.transport, 0, run_with, scope=scope)
        elif incoming:
            self._executor = ReceiveExecutor(incoming, self.transport, offset, run_with, scope=scope,
                                             forward_to=self._relay_children(relay),
                                             chunk_bytes=settings.relay.chunk_bytes,
                                             slice_pieces=settings.relay.slice_pieces, relayed=True)

    def _relay_children(self, relay: RelayPlan) -> list[int]:
        """The global ranks this rank forwards each round to (its replica's children's rank of its index)."""
        offset = self.sizes[Side.TRAIN]
        return sorted({offset + m.dst for msgs in relay.schedule.rounds_of_source(self.rank) for m in msgs})

    def _relay_source(self) -> str:
        """How a failed step names where this rank's step comes from, when its parent replica relays it."""
        relay = self.relay
        if relay is None or relay.within_nodes or relay.fed_by_trainers(self.rank):
            return ""
        parent = relay.tree.parent[relay.replica_of(self.rank)]
        parent_rank = parent * relay.replica_size + self.rank % relay.replica_size
        if self.settings is not None and self.settings.relay.broadcast:
            return f" (relayed: it hears the trainers' broadcasts with gen rank {parent_rank} of replica {parent})"
        return f" (relayed: its relay parent is gen rank {parent_rank}, replica {parent})"

    def _network_executor(self, rounds: list[list[Message]], scope: HeaderScope, steps: StepCount | None = None,
                          forward_to: Sequence[int] = ()) -> ReceiveExecutor:
        """A receive executor for ``rounds`` from the train ranks (the whole schedule's, or a subset's);
        ``forward_to``: the global ranks it relays each round to (empty: none)."""
        assert self.transport is not None and self.schedule is not None and self.settings is not None
        return ReceiveExecutor(rounds, self.transport, 0, executor_settings(self.schedule, self.settings),
                               scope=scope, steps=steps, forward_to=forward_to,
                               chunk_bytes=self.settings.relay.chunk_bytes if forward_to else 0,
                               slice_pieces=self.settings.relay.slice_pieces)

    def _subset_refusal(self) -> str | None:
        if self._quantizing.items:
            return "it quantizes pieces itself after the whole step landed (receiver-side quantization)"
        return super()._subset_refusal()

    def _bound_views(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._quantizing.bind(views)  # receiver-quantized pieces land in high precision first

    def _bind_step(self) -> list[tuple[str, torch.Tensor]]:
        """(Re)bind destination views for this step; returns the fresh loader-path tensors."""
        rebind = self.plugins.begin_update(self.model)
        if rebind:
            pieces = self._local_pieces()
            if [p.meta for p in pieces] != [p.meta for p in self._pieces]:
                raise RefitError("the generation model's destination pieces changed after "
                                 "refit_begin_update; a plugin must return the same pieces every time")
            self._pieces = pieces
        elif self._memory is not None:  # the steps write into the views bound earlier: one replaced goes stale
            problem = self._memory_problem()
            if problem is not None:
                raise RefitError(problem)
        if not self._loader:
            if rebind or self._memory is None:
                self._bind(self._pieces)
            return []
        fast = len(self._pieces) - len(self._loader)
        buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in self._loader]
        loaded: list[Piece] = [DestinationPiece(s, s.full_box(), b) for s, b in zip(self._loader, buffers)]
        self._bind(self._pieces[:fast] + loaded)
        return [(s.name, b) for s, b in zip(self._loader, buffers)]

    def held_pieces(self) -> list[Piece]:
        """The destination pieces in engine memory this rank writes (the loader path's excluded), as its last step
        bound them (its setup's before the first): what a fleet's feeder forwards (:mod:`refit_core.fleet.mirror`)."""
        return self._pieces[:len(self._pieces) - len(self._loader)]

    def _bound_names(self) -> list[str]:
        """The names of the pieces bound last (empty before the first bind)."""
        return [] if self._memory is None else self._memory.names

    @property
    def needs_refit(self) -> bool:
        """True while this rank must not serve until the next successful ``receive()`` (after ``close()``
        and ``setup()``): a failed step tore some of its weights, or it could not learn whether a staged
        step was applied by the other gen ranks. False: its weights are one whole version (an engine
        whose ranks hold different versions must still not serve: the engine plugins check that)."""
        failure = self.last_failure
        return failure is not None and (not failure.clean or failure.undecided)

    def receive(self, *, only: Iterable[str] | None = None) -> StepStats:
        """Receive one step's weights into the engine; ``stats.version`` is the sender's version.

        ``only``: the tensors this step moves (None: every tensor of the plan), as the train ranks name
        them in ``send(only=...)`` (see there); the others keep their bytes, the loader path is handed
        only the named tensors, and ``version`` advances all the same (it names the last step landed).

        On failure raises :class:`~refit_core.contract.failures.StepFailedError`, whose ``failure`` names the
        destination tensors the step touched (none in staged mode, unless colocated pairs, which land in
        place, had started); ``version`` is not advanced, the plugin's ``refit_abort_update`` is told,
        and the endpoint needs ``close()`` + ``setup()``.
        """
        self._require_step()
        step, self._steps = self._steps, self._steps + 1
        touched: set[int] = set()  # the bound pieces this step may write: a failure's torn report
        self._quantizing.begin_step()
        loader_weights: list[tuple[str, torch.Tensor]] = []
        ballot = _Ballot()
        executor = self._executor
        try:
            loader_weights = self._bind_step()
            subset, executor = self._step_executor(only)
            assert executor is None or isinstance(executor, ReceiveExecutor)
            if subset is not None:
                loader_weights = [(name, tensor) for name, tensor in loader_weights if name in subset.names]
            stats = self._receive_parts(executor, touched)
            if self._relay_out is not None:  # forwarding within nodes: only what has fully landed here
                self._relay_out.run(stats.version, touched=touched)
            if self._mode is UpdateMode.STAGED:
                self._await_commit(step, ballot)
                if executor is not None:
                    executor.commit(touched)
            self._quantizing.finish()
            if loader_weights:
                bound = len(self._bound_names())
                touched.update(range(bound - len(loader_weights), bound))
                self.plugins.load_weights(self.model, self._experts.ungrouped(loader_weights))
            if self._mode is UpdateMode.IN_PLACE and self._votes:
                commit.vote(self._require_rendezvous(), step, commit.Vote(self.rank))
                ballot.voted = True
        except Exception as exc:
            raise self._step_failed(step, exc, ballot, touched, executor) from exc
        self.plugins.finish_update(self.model, stats.version)
        self.version = stats.version
        self.last_failure = None
        if ballot.decision is not None and self._rdv is not None:
            commit.settle(self._rdv, step, commit.Settlement(self.rank, self.version))
        log.info("refit received version %d: %s in %.3f s (%.2f GB/s)", stats.version,
                 format_bytes(stats.bytes), stats.seconds, stats.gbps)
        return stats

    @property
    def _votes(self) -> bool:
        """Whether this rank votes on every step (staged mode always; in place with ``confirm``)."""
        assert self.settings is not None
        return self.settings.mode is UpdateMode.STAGED or self.settings.confirm

    def _await_commit(self, step: int, ballot: _Ballot) -> None:
        """Vote that staged ``step`` landed here and read train rank 0's decision into ``ballot``; raise
        unless it commits the step (:class:`~refit_core.endpoints.commit.DecisionUnknown` if it cannot
        be read in time)."""
        rdv = self._require_rendezvous()
        commit.vote(rdv, step, commit.Vote(self.rank))
        ballot.voted = True
        timeout_s = self.options.timeout_s
        ballot.decision = commit.await_decision(rdv, step, timeout_s)
        if ballot.decision.verdict is commit.Verdict.ABORT:
            raise TransferError(f"train rank 0 aborted step {step}: {ballot.decision.reason}")

    def _receive_parts(self, executor: ReceiveExecutor | None, touched: set[int]) -> StepStats:
        """This step's network part (run by ``executor``) and colocated part; colocated peers hear of any
        failure. ``touched`` gathers the bound pieces whose destinations may have been written."""
        colocated = self._colocated
        if not isinstance(colocated, ColocatedReceiver):
            assert executor is not None
            return executor.run(touched=touched, timeline=self.timeline)
        start = time.perf_counter()
        version = colocated.start()  # on a bad header it has told its peers already
        touched |= colocated.pieces  # colocated copies land in place, also in staged mode
        try:
            stats = executor.run(version, touched=touched, timeline=self.timeline) if executor is not None else None
            if stats is not None and stats.version != version:
                raise TransferError(f"train ranks sent different weight versions {sorted({version, stats.version})} "
                                    "in one step: every train rank must call send() with the same version")
        except Exception as exc:
            colocated.finish(error=f"gen rank {self.rank}: {exc}")
            raise
        colocated.finish()
        return combined_stats(stats, version, colocated, start)

    def _step_failed(self, step: int, exc: Exception, ballot: _Ballot, touched: set[int],
                     executor: ReceiveExecutor | SendExecutor | None) -> StepFailedError:
        """Record what a failed step touched, tell the peers and the plugin; the error to raise (``executor``:
        the network executor the step ran, whose staged step is dropped)."""
        if isinstance(executor, ReceiveExecutor):
            executor.discard()
        touched = self._quantizing.torn(touched)  # receiver-quantized pieces land in stand-ins first
        # first: once every rank noted its failure, train rank 0 may close the store
        cause = commit.step_failed(self._rdv, step, self.me, self.sizes.get(Side.TRAIN, 0), str(exc))
        if self.settings is not None and self._votes and not ballot.voted and self._rdv is not None:
            try:
                commit.vote(self._rdv, step, commit.Vote(self.rank, str(exc)))
            except RefitError:
                pass  # the store's host is gone: the others fail on that too
        bound = self._bound_names()
        names = sorted({bound[i] for i in touched if i < len(bound)})
        undecided = isinstance(exc, commit.DecisionUnknown)
        failure = StepFailure(step, self._mode, str(exc), tuple(names), undecided)
        self.last_failure = failure
        if ballot.decision is not None and self._rdv is not None:  # train rank 0 waits to hear what we did
            commit.settle(self._rdv, step, commit.Settlement(self.rank, self.version,
                                                             None if failure.clean else str(exc)))
        self._break(str(exc))
        handled = self.plugins.abort_update(self.model, list(failure.torn))
        held = ("the weights it held before this session" if self.version is None
                else f"version {self.version}")
        if undecided:
            outcome = (f"this rank keeps {held}, but other gen ranks may have applied the step: "
                       "it refuses to serve (needs_refit) until the next successful refit")
        elif failure.clean:
            outcome = "the engine's weights are unchanged"
        else:
            shown = TORN_NAMES_SHOWN
            outcome = (f"{len(names)} destination tensor(s) may be partly written (torn): "
                       f"{', '.join(names[:shown])}{' ...' if len(names) > shown else ''}; the engine needs a new "
                       f"refit and keeps {held}")
        why = str(exc) if cause is None else f"{cause} (here: {exc})"
        error = StepFailedError(f"refit step {step} failed on gen rank {self.rank}{self._relay_source()}: {why}; "
                                f"{outcome}", failure)
        if handled is False:
            error.add_note(f"refit: gen rank {self.rank}: the engine could not restore its previous weights "
                           "(refit_abort_update returned False); it may hold a mix of versions until the "
                           "next successful receive()")
        return error


__all__ = ["RefitReceiver", "StepStats"]
