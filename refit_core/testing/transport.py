"""The transport conformance check: an installed transport, opened through the registry in real processes.

:func:`check_transport` spawns ``world_size`` ranks on this machine around one TCPStore and a
:class:`~refit_core.net.transport.watch.StoreWatch` (what a refit hands a transport), opens the named
transport on each through the registry, and checks, in order:

- ``opens``: the name resolves to a network transport, which opens on every rank, its ``kind`` that name;
- ``register``: :meth:`~refit_core.net.transport.base.Transport.register` takes every buffer of the checks;
- ``exchanges land bitwise``: every rank sends every other rank, in one exchange, messages of several sizes
  and dtypes, all pairs at once and both directions; each lands bit for bit;
- ``after fences``: a send posted ``after`` a fence that fills its tensor only when waited on carries the
  filled bytes (the transport waited for the fence before it read the tensor);
- ``control exchange``: a ``control=True`` exchange (the step header) lands both ways;
- ``broadcasts land bitwise``: two groups (every rank, rooted at rank 0; then at the last rank) opened with
  :meth:`~refit_core.net.transport.base.Transport.open_broadcasts`, a broadcast of several messages in each;
  every member holds the root's bytes bit for bit (a transport may keep the default, which sends them);
- ``non-contiguous refused``: a non-contiguous tensor raises a ``TransferError`` that says so, before
  anything is posted;
- ``abort reaches peers``: rank 0 aborts with a receive in flight; every other rank's wait on it fails with a
  ``TransferError`` within :data:`ABORT_WITHIN_S`, not at its deadline;
- ``close is idempotent``: ``close()`` twice, after ``abort()`` too, raises nothing.

A transport registered only in this process (:func:`~refit_core.net.transport.registry.register_transport`)
is not seen by the spawned ranks: install it (an entry point of group ``refit.transports``), or name its
record with ``source`` (``"module:attr"``), which every rank registers first.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from refit_core.contract.errors import TransferError
from refit_core.contract.side import Side
from refit_core.kit.launch import RankFailure, free_port, spawn
from refit_core.net.transport.base import Fence, Transport
from refit_core.net.transport.kind import TransportType
from refit_core.net.transport.registry import network_type, open_transport, register_transport, resolve_kind
from refit_core.net.transport.watch import StoreWatch
from refit_core.testing.results import CheckResult, Outcome, require

ABORT_WITHIN_S = 10.0
"""How soon a peer's wait must fail once a rank aborted (a refit's peers hear within about a second)."""
MESSAGES = ((torch.float32, 1), (torch.bfloat16, 257), (torch.int64, 4096), (torch.uint8, 1 << 18))
"""The (dtype, elements) of the messages each rank sends each other rank in one exchange."""

RankChecks = list[tuple[str, list[str]]]


@dataclass(frozen=True)
class _Job:
    """What every rank of one check runs with."""

    name: str
    store_port: int
    device: str
    timeout_s: float
    source: str | None


def _device(spec: str, rank: int) -> torch.device:
    if spec == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(spec)


def _pattern(src: int, dst: int, index: int, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    """Bytes that differ per (sender, receiver, message): a landing in the wrong place shows."""
    gen = torch.Generator().manual_seed(1000 * src + 10 * dst + index)
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8,
                        generator=gen)
    return raw.view(dtype).to(device)


def _differs(got: torch.Tensor, want: torch.Tensor) -> bool:
    return not torch.equal(got.reshape(-1).view(torch.uint8).cpu(), want.reshape(-1).view(torch.uint8).cpu())


class _FillOnWait(Fence):
    """A fence whose work fills ``tensor`` with ``truth`` when it is waited for (on the stream when one is
    given): a transport that reads the tensor before waiting sends the stale bytes."""

    def __init__(self, tensor: torch.Tensor, truth: torch.Tensor) -> None:
        self.tensor, self.truth, self.waited = tensor, truth, False

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self._fill(stream)

    def synchronize(self, timeout_s: float) -> None:
        self._fill(None)

    def _fill(self, stream: torch.cuda.Stream | None) -> None:
        if self.waited:
            return
        self.waited = True
        if stream is not None:
            with torch.cuda.stream(stream):
                self.tensor.copy_(self.truth)
        else:
            self.tensor.copy_(self.truth)
            if self.tensor.is_cuda:
                torch.cuda.synchronize(self.tensor.device)


class _Rank:
    """One rank's side of the checks: its transport, its peers and its deadline."""

    def __init__(self, transport: Transport, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
        self.transport, self.rank, self.world, self.device, self.timeout_s = transport, rank, world, device, timeout_s
        self.peers = [p for p in range(world) if p != rank]

    def _finish(self, fence: Fence) -> None:
        fence.synchronize(self.timeout_s)

    def register(self) -> list[str]:
        """Hand the transport buffers of every size the exchanges use (it raises on a problem)."""
        self.transport.register([torch.empty(numel, dtype=dtype, device=self.device) for dtype, numel in MESSAGES])
        return []

    def exchanges(self) -> list[str]:
        sends = [(p, _pattern(self.rank, p, i, dt, n, self.device)) for p in self.peers
                 for i, (dt, n) in enumerate(MESSAGES)]
        recvs = [(p, torch.zeros(n, dtype=dt, device=self.device)) for p in self.peers for dt, n in MESSAGES]
        self._finish(self.transport.exchange(sends, recvs))
        problems = []
        for k, (peer, got) in enumerate(recvs):
            index = k % len(MESSAGES)
            dtype, numel = MESSAGES[index]
            if _differs(got, _pattern(peer, self.rank, index, dtype, numel, self.device)):
                problems.append(f"rank {self.rank}: message {index} ({numel} x {dtype}) from rank {peer} "
                                "did not land bit for bit")
        return problems

    def after_fences(self) -> list[str]:
        numel = 1 << 12
        sends, fences = [], []
        for p in self.peers:
            tensor = torch.zeros(numel, dtype=torch.float32, device=self.device)
            fences.append(_FillOnWait(tensor, _pattern(self.rank, p, 7, torch.float32, numel, self.device)))
            sends.append((p, tensor))
        recvs = [(p, torch.zeros(numel, dtype=torch.float32, device=self.device)) for p in self.peers]
        self._finish(self.transport.exchange(sends, recvs, after=fences))
        problems = [f"rank {self.rank}: the after fences were never waited for" for f in fences if not f.waited][:1]
        for peer, got in recvs:
            if _differs(got, _pattern(peer, self.rank, 7, torch.float32, numel, self.device)):
                problems.append(f"rank {self.rank}: rank {peer} sent its tensor before the fence it was posted "
                                "after completed")
        return problems

    def control(self) -> list[str]:
        sends = [(p, torch.tensor([self.rank, p, 42], dtype=torch.int64, device=self.device)) for p in self.peers]
        recvs = [(p, torch.zeros(3, dtype=torch.int64, device=self.device)) for p in self.peers]
        self._finish(self.transport.exchange(sends, recvs, control=True))
        return [f"rank {self.rank}: the control exchange from rank {p} landed {got.tolist()}"
                for p, got in recvs if got.tolist() != [p, self.rank, 42]]

    def broadcasts(self) -> list[str]:
        last = self.world - 1
        groups = [tuple(range(self.world)), (last, *range(last))]
        self.transport.open_broadcasts(groups, self.rank)
        posts = [(g, _pattern(root, self.world, i, dt, n, self.device) if self.rank == root else
                  torch.zeros(n, dtype=dt, device=self.device))
                 for g, root in enumerate((0, last)) for i, (dt, n) in enumerate(MESSAGES)]
        self._finish(self.transport.broadcast(posts))
        problems = []
        for k, (group, got) in enumerate(posts):
            index, root = k % len(MESSAGES), groups[group][0]
            dtype, numel = MESSAGES[index]
            if _differs(got, _pattern(root, self.world, index, dtype, numel, self.device)):
                problems.append(f"rank {self.rank}: broadcast message {index} ({numel} x {dtype}) from rank {root} "
                                "did not land bit for bit")
        return problems

    def non_contiguous(self) -> list[str]:
        strided = torch.zeros(8, 8, device=self.device)[:, ::2]
        try:
            self.transport.exchange([(self.peers[0], strided)], [])
        except TransferError as exc:
            return [] if "contiguous" in str(exc) else [f"rank {self.rank}: refused, but without saying why: {exc}"]
        except Exception as exc:  # noqa: BLE001 - reported as the problem
            return [f"rank {self.rank}: raised {type(exc).__name__} (not a TransferError): {exc}"]
        return [f"rank {self.rank}: a non-contiguous tensor was accepted"]

    def abort(self) -> list[str]:
        """Rank 0 aborts with a receive from rank 1 in flight; every other rank waits on rank 0."""
        if self.rank == 0:
            fence = self.transport.exchange([], [(1, torch.zeros(4, device=self.device))])
            time.sleep(0.5)  # the others are waiting by now
            self.transport.abort("conformance check: rank 0 aborts")
            del fence
            return []
        fence = self.transport.exchange([], [(0, torch.zeros(4, device=self.device))])
        began = time.monotonic()
        try:
            fence.synchronize(self.timeout_s)
        except TransferError:
            took = time.monotonic() - began
            return [] if took <= ABORT_WITHIN_S else [f"rank {self.rank}: its wait failed only after {took:.1f} s"]
        except Exception as exc:  # noqa: BLE001 - reported as the problem
            return [f"rank {self.rank}: its wait raised {type(exc).__name__} (not a TransferError): {exc}"]
        return [f"rank {self.rank}: its wait on the aborted rank 0 completed"]

    def close_twice(self) -> list[str]:
        self.transport.close()
        self.transport.close()
        return []


def _barrier(store: dist.Store, name: str, rank: int, world: int) -> None:
    store.set(f"conformance/{name}/{rank}", "1")
    store.wait([f"conformance/{name}/{r}" for r in range(world)])


def _checked(name: str, check: Callable[[], list[str]]) -> tuple[str, list[str]]:
    try:
        return name, check()
    except Exception as exc:  # noqa: BLE001 - a crashing check is a failed check, reported by name
        return name, [f"raised {type(exc).__name__}: {exc}"]


def transport_rank(rank: int, world: int, job: _Job) -> RankChecks:
    """One rank of :func:`check_transport` (spawned): open the transport, run every check in step."""
    torch.set_num_threads(1)
    if job.source is not None:
        register_transport(_load(job.source), replace=True)
    store = dist.TCPStore("127.0.0.1", job.store_port, world, rank == 0, timedelta(seconds=job.timeout_s))
    device = _device(job.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    watch = StoreWatch(store, {Side.TRAIN: 1, Side.GEN: world - 1})
    try:
        transport = open_transport(job.name, store, rank, world, device, job.timeout_s, watch=watch,
                                   rendezvous=f"127.0.0.1:{job.store_port}")
    except Exception as exc:  # noqa: BLE001 - reported as the failed check
        return [("opens", [f"rank {rank}: raised {type(exc).__name__}: {exc}"])]
    me = _Rank(transport, rank, world, device, job.timeout_s)
    kind = resolve_kind(job.name, device)
    results: RankChecks = [("opens", [] if transport.kind == kind else
                            [f"rank {rank}: its kind is {transport.kind!r}, not {kind!r}"])]
    results.append(_checked("register", me.register))
    for name, check in (("exchanges land bitwise", me.exchanges), ("after fences", me.after_fences),
                        ("control exchange", me.control), ("broadcasts land bitwise", me.broadcasts),
                        ("non-contiguous refused", me.non_contiguous)):
        _barrier(store, name, rank, world)
        results.append(_checked(name, check))
    _barrier(store, "abort", rank, world)
    results.append(_checked("abort reaches peers", me.abort))
    results.append(_checked("close is idempotent", me.close_twice))
    _barrier(store, "done", rank, world)
    if rank == 0:  # the store's host stays until every rank is through its last wait on the store
        store.wait([f"conformance/bye/{r}" for r in range(1, world)])
    else:
        store.set(f"conformance/bye/{rank}", "1")
    return results


def _load(source: str) -> TransportType:
    module, _, attr = source.partition(":")
    kind = getattr(importlib.import_module(module), attr)
    if not isinstance(kind, TransportType):
        raise TypeError(f"{source} is a {type(kind).__name__}, not a TransportType")
    return kind


def check_transport(name: str, *, world_size: int = 3, device: str = "cpu", timeout_s: float = 30.0,
                    source: str | None = None) -> list[CheckResult]:
    """Check the installed transport ``name`` across ``world_size`` spawned ranks on ``device`` (``"cpu"``, or
    ``"cuda"``: rank r on GPU r modulo the GPUs); ``timeout_s`` bounds each rank's waits.

    ``source``: ``"module:attr"`` of a :class:`~refit_core.net.transport.kind.TransportType` that every rank
    registers before opening ``name`` (a transport not installed yet; None: the installed one).

    Returns one :class:`~refit_core.testing.results.CheckResult` per check; raises
    :class:`~refit_core.testing.results.ConformanceError` listing every failed one (an unknown name or a
    kind that is no network transport too).
    """
    if world_size < 2:
        raise ValueError("check_transport needs at least 2 ranks")
    try:
        if source is not None:
            register_transport(_load(source), replace=True)
        network_type(resolve_kind(name, torch.device(device)))
    except Exception as exc:  # noqa: BLE001 - an unknown transport is a failed check like any other
        return require([CheckResult(f"{name}: opens", Outcome.FAILED, (str(exc),))])
    job = _Job(name, free_port(), device, timeout_s, source)
    try:
        per_rank = spawn(transport_rank, world_size, job, timeout_s=4 * timeout_s + 60)
    except RankFailure as exc:
        return require([CheckResult(f"{name}: ranks", Outcome.FAILED, (str(exc),))])
    merged: dict[str, list[str]] = {}
    for checks in per_rank:
        for check, problems in checks:
            merged.setdefault(check, []).extend(problems)
    return require([CheckResult(f"{name}: {check}", Outcome.FAILED if problems else Outcome.PASSED, tuple(problems))
                    for check, problems in merged.items()])


__all__ = ["ABORT_WITHIN_S", "check_transport", "transport_rank"]
