"""The CPU transport: a private gloo process group built from the refit's own store.

gloo listens on the interface this rank reaches the rendezvous through (a local job's ``127.0.0.1``
rendezvous keeps it on loopback), not on whatever the hostname resolves to.

Waits run on a helper thread (:class:`_Waiter`) while the caller watches: gloo's ``wait`` cannot be
interrupted (not by ``ProcessGroupGloo.abort()`` either), and a message that a dead peer left half
transferred is never completed nor failed until gloo's own timeout (its pair error reaches only
operations that have not started moving bytes). So the caller waits on the helper in slices and asks
its :class:`~refit_core.net.transport.watch.PeerWatch` whether the step is lost; when it is, it raises
at once, and the helper stays parked in that wait until gloo's timeout (``timeout_s``) releases it.
Small exchanges too: a peer killed between two tiny messages left train rank 0 of a 2 x 2 toy refit
waiting for gloo's timeout in every try (``tests/faults/test_transfer_faults.py``).

A parked helper must not wake while the interpreter finalizes: Python 3.11 ends a thread that wants
the GIL back then by unwinding it, and the unwind through torch's GIL guard aborts the process
("terminate called without an active exception", seen in CI after a step a peer died in). So the
process's exit first waits for every parked helper, at most until gloo's timeout releases it.
"""

from __future__ import annotations

import atexit
import queue
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from refit_core.contract.errors import TransferError
from refit_core.contract.options import TransportKind
from refit_core.net.transport.base import TransportCounters, Fence, Transport, check_contiguous
from refit_core.net.transport.kind import TransportContext, TransportType
from refit_core.net.transport.watch import FIRST_CHECK_S, MAX_CHECK_S, PeerWatch


def _failure(rank: int, peer: int, what: str, exc: BaseException) -> str:
    text = str(exc)
    cause = ("timed out: a peer is stopped, hung or much slower" if "imed out" in text
             else "a peer died or closed its connection")
    return (f"gloo {what} between rank {rank} and rank {peer} failed "
            f"({cause}): {text.splitlines()[0] if text else type(exc).__name__}")


def interface_toward(host: str, port: int) -> str:
    """This machine's address on the interface its packets to ``host`` leave through (no packet is sent)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


CLOSE_JOIN_S = 2.0
"""How long ``close()`` waits for a healthy transport's helper thread to end."""


@dataclass(eq=False)
class _Job:
    """Works the helper thread waits for, in order; ``peer`` is the one it waits on now."""

    works: list[tuple[int, dist.Work]]
    limit: timedelta
    peer: int
    done: threading.Event = field(default_factory=threading.Event)
    error: tuple[int, BaseException] | None = None


class _Waiter:
    """One daemon thread that runs a transport's blocking gloo waits, one job at a time."""

    def __init__(self, rank: int) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._queued_s = 0.0  # the longest the jobs submitted and not finished can still take
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"refit-gloo-wait-{rank}", daemon=True)
        self._thread.start()
        _waiters.add(self)

    def submit(self, works: list[tuple[int, dist.Work]], limit: timedelta) -> _Job:
        job = _Job(works, limit, works[0][0])
        with self._lock:
            self._queued_s += limit.total_seconds() * len(works)
        self._jobs.put(job)
        return job

    def busy_for_at_most_s(self) -> float:
        """How long the helper may still be inside gloo (0: idle or ended)."""
        with self._lock:
            return self._queued_s if self._thread.is_alive() else 0.0

    def stop(self, wait_s: float = 0.0) -> None:
        """Let the thread end after its current job (a job given up on ends at gloo's timeout); wait up to
        ``wait_s`` for it to end (a process that exits with the thread inside gloo may abort)."""
        self._jobs.put(None)
        if wait_s > 0:
            self._thread.join(wait_s)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._wait_for(job)
            job.done.set()
            del job

    def _wait_for(self, job: _Job) -> None:
        """Wait for ``job``'s works in order. No gloo Work outlives this frame: the thread must hold none
        when it ends, which may happen while the interpreter finalizes (see the module's docstring)."""
        try:
            for peer, work in job.works:
                job.peer = peer
                try:
                    work.wait(job.limit)
                except Exception as exc:  # noqa: BLE001 - handed to the caller, which raises it named
                    job.error = (peer, exc.with_traceback(None))  # its frames would hold the Work
                    break
        finally:
            with self._lock:
                self._queued_s -= job.limit.total_seconds() * len(job.works)
            job.works = []  # the caller may keep the job


_waiters: weakref.WeakSet[_Waiter] = weakref.WeakSet()


@atexit.register
def _let_parked_waits_end() -> None:
    """Runs before the interpreter finalizes: stop every helper and wait for the parked ones (above)."""
    for waiter in list(_waiters):
        waiter.stop(wait_s=1.0)  # an idle helper ends at once
    parked = [w for w in list(_waiters) if w.busy_for_at_most_s() > 0]
    if parked:
        longest = max(w.busy_for_at_most_s() for w in parked)
        print(f"refit: this process ends once gloo releases a transfer it abandoned (gloo cannot cancel one): "
              f"at most {longest:.0f} s", file=sys.stderr, flush=True)
        for waiter in parked:
            waiter.stop(wait_s=waiter.busy_for_at_most_s() + 1.0)


class _WorkFence(Fence):
    """Completion of the posted operations, each with the peer it talks to."""

    def __init__(self, works: list[tuple[int, dist.Work]], transport: GlooTransport) -> None:
        self._works = works
        self._transport = transport

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self.synchronize(timeout_s=0)

    def synchronize(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` (0: the transport's timeout). A peer that closed its connection,
        or one that is gone or gave up (the watch), ends the wait within about a second."""
        if self._works:
            works, self._works = self._works, []
            self._transport._await(works, timeout_s if timeout_s > 0 else self._transport.timeout_s)


class GlooTransport(Transport):
    """Point-to-point over gloo; never the process's default group (trainers and engines own theirs).

    ``watch`` (None: none) is asked while a wait is slow; ``interface`` is the address gloo listens on
    (None: gloo's default, the hostname's).
    """

    kind = TransportKind.GLOO

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                 watch: PeerWatch | None = None, interface: str | None = None) -> None:
        self.device = torch.device("cpu")
        self.rank = rank
        self.timeout_s = timeout_s
        self.watch = watch
        options: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=interface) if interface
                            else dist.ProcessGroupGloo.create_default_device()]
        self._pg: Any = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, options)
        self._waiter = _Waiter(rank)
        self._broken: str | None = None  # why this transport gave up on a step; it posts nothing more
        self._in_flight = 0  # fences posted and not yet waited for
        self.counters: TransportCounters = TransportCounters()

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = (), *, control: bool = False) -> Fence:
        check_contiguous(sends)
        check_contiguous(recvs)
        for fence in after:
            fence.wait()
        pg = self._pg
        if pg is None or self._broken is not None:
            raise TransferError(f"the gloo transport of rank {self.rank} is closed"
                                + (f" (it gave up on a step: {self._broken})" if self._broken else ""))
        works: list[tuple[int, dist.Work]] = []
        for peer, tensor in recvs:
            works.append((peer, self._post(pg.recv, tensor, peer)))
        for peer, tensor in sends:
            works.append((peer, self._post(pg.send, tensor, peer)))
        self._in_flight += bool(works)
        self.counters.add(sends, recvs, control)
        return _WorkFence(works, self)

    def _post(self, operation: Callable[[list[torch.Tensor], int, int], dist.Work], tensor: torch.Tensor,
              peer: int) -> dist.Work:
        try:  # posting fails too: gloo reports a peer that already closed its connection here
            return operation([tensor], peer, 0)
        except Exception as exc:  # every transport failure is a TransferError
            raise self._give_up(_failure(self.rank, peer, "post", exc)) from exc

    def _await(self, works: list[tuple[int, dist.Work]], timeout_s: float) -> None:
        """Wait for ``works`` on the helper thread, asking the watch while it takes long."""
        job = self._waiter.submit(works, timedelta(seconds=timeout_s))
        deadline = time.monotonic() + timeout_s
        interval = FIRST_CHECK_S
        while not job.done.wait(max(0.0, min(interval, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise self._give_up(f"gloo exchange between rank {self.rank} and rank {job.peer} did not complete "
                                    f"within {timeout_s:.0f} s (a peer is stopped, hung or much slower)")
            loss = self.watch.lost(job.peer) if self.watch is not None else None
            if loss is not None:
                assert self.watch is not None  # published too: ranks waiting on this one may not see the loss
                raise self._give_up(f"gloo exchange between rank {self.rank} and rank {job.peer} abandoned: "
                                    f"{loss.describe(self.watch.names)}")
            interval = min(2 * interval, MAX_CHECK_S)
        if job.error is not None:
            peer, error = job.error
            raise self._give_up(_failure(self.rank, peer, "exchange", error)) from error
        self._in_flight -= 1

    def _give_up(self, reason: str) -> TransferError:
        """This rank abandons the step: nothing more is posted, and the others hear why (the first
        rank to give up is the one they hear of)."""
        if self._broken is None:
            self._broken = reason
            if self.watch is not None:
                self.watch.give_up(self.rank, reason)
        return TransferError(reason)

    def abort(self, reason: str) -> None:
        self._give_up(f"rank {self.rank} left the step ({reason})")  # peers waiting on it, or on the step, stop
        self.close()

    def close(self) -> None:
        """Drop the process group (and its connections); safe after a failed or timed-out step."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        if self._in_flight and self._broken is None:
            self._give_up(f"rank {self.rank} closed its transport with messages in flight")
        self._waiter.stop(wait_s=0.0 if self._broken else CLOSE_JOIN_S)  # a healthy helper ends at once
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - already broken: dropping it is all that is left
            pass


def open_gloo(context: TransportContext) -> GlooTransport:
    """The gloo transport of ``context``, listening on the interface that reaches its rendezvous (gloo's
    default, the hostname's, when that is unknown)."""
    host, _, port = (context.rendezvous or "").rpartition(":")
    interface = interface_toward(host.strip("[]"), int(port)) if context.rendezvous else None
    return GlooTransport(context.store, context.rank, context.world_size, context.timeout_s, context.watch, interface)


GLOO = TransportType(TransportKind.GLOO, open_gloo, summary="CPU tensors over a private gloo process group")
"""The gloo kind, registered under ``refit.transports`` by refit-core's ``pyproject.toml``."""
