"""The step header is a *control* exchange: the executors post it as one, first in every step, and every
data round as data; the NCCL transport puts a control exchange on each link's first communicator and
restarts the rotation of data operations there (so both ends agree on the communicator of every message,
and every step maps its messages to communicators as the step before).

The executors run over two real gloo transports (threads, an in-memory store); the NCCL rule is checked on
the transport's link choice alone (placeholder links: nothing is posted, CI has no GPU; the two-GPU test
``tests/gpu/test_nccl_refit.py`` runs it for real)."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from refit_core.contract.side import Side
from refit_core.contract.spec import Box
from refit_core.apps import same_bytes
from refit_core.net.transport.gloo import GlooTransport
from refit_core.net.transport.nccl import PAIRWISE_COMMS_PER_GPU, SMALL_OP_BYTES, NcclTransport, pairwise_comms_per_gpu
from refit_core.net.transport.watch import StoreWatch
from refit_core.plan.items import Transfer
from refit_core.plan.schedule import build_schedule
from refit_core.run.executor import ExecutorSettings, ReceiveExecutor, SendExecutor

DEADLINE_S = 30
SHAPES = [(64, 32), (8, 32), (128, 16)]


class _Recorded:
    """A real transport whose exchanges are noted as ``"control"`` or ``"data"``, in order."""

    def __init__(self, transport: GlooTransport) -> None:
        self.transport, self.kinds = transport, []
        real = transport.exchange

        def exchange(sends: Any, recvs: Any, after: Any = (), *, control: bool = False) -> Any:
            self.kinds.append("control" if control else "data")
            return real(sends, recvs, after, control=control)
        transport.exchange = exchange  # type: ignore[method-assign]


def _transports(store: dist.Store) -> list[GlooTransport]:
    out: list[GlooTransport | None] = [None, None]

    def open_one(rank: int) -> None:
        out[rank] = GlooTransport(store, rank, 2, DEADLINE_S, StoreWatch(store, {Side.TRAIN: 1, Side.GEN: 1}),
                                  "127.0.0.1")

    threads = [threading.Thread(target=open_one, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert all(t is not None for t in out)
    return out  # type: ignore[return-value]


def test_every_step_posts_one_control_exchange_first_then_data_rounds():
    transfers = [Transfer(f"w{i}", 0, i, Box((0, 0), shape), 0, i, Box((0, 0), shape), torch.float32)
                 for i, shape in enumerate(SHAPES)]
    bucket = 16 << 10  # 17 KiB in all (8 + 1 + 8): at least two rounds
    schedule = build_schedule(transfers, 1, 1, bucket)
    assert len(schedule.rounds) >= 2
    sources = [torch.randn(shape) for shape in SHAPES]
    targets = [torch.zeros(shape) for shape in SHAPES]
    train, gen = (_Recorded(t) for t in _transports(dist.HashStore()))
    settings = ExecutorSettings(bucket_bytes=bucket, num_buffers=2, zero_copy=True, fingerprint=schedule.fingerprint,
                                timeout_s=DEADLINE_S)
    sender = SendExecutor(schedule.rounds_of_source(0), train.transport, 1, settings)
    receiver = ReceiveExecutor(schedule.rounds_of_destination(0), gen.transport, 0, settings)
    sender.bind(sources)
    receiver.bind(targets)
    versions: list[int] = []
    try:
        for step in range(2):
            for source in sources:
                source.add_(1)
            thread = threading.Thread(target=sender.run, args=(step,))
            thread.start()
            versions.append(receiver.run().version)
            thread.join(DEADLINE_S)
            assert all(same_bytes(t, s) for t, s in zip(targets, sources))
    finally:
        train.transport.close()
        gen.transport.close()
    assert versions == [0, 1]
    rounds = len(schedule.rounds)
    for side in (train, gen):
        assert side.kinds == (["control"] + ["data"] * rounds) * 2, side.kinds


class _Placeholder:
    """A link's stand-in: only its name and peer rank are read when operations are grouped."""

    def __init__(self, name: str) -> None:
        self.comm, self.peer_rank = name, 0


def _comms_of(transport: NcclTransport, sends: list[tuple[int, Any]], recvs: list[tuple[int, Any]],
              control: bool = False) -> list[tuple[Any, str]]:
    """(communicator, "send" / "recv") of every operation of one exchange, as the transport groups them."""
    return [(group.link.comm, kind) for group in transport._groups(sends, recvs, control)
            for kind, ops in (("send", group.sends), ("recv", group.recvs)) for _ in ops]


def _placeholder_transport(comms: int) -> NcclTransport:
    transport = NcclTransport.__new__(NcclTransport)  # the link choice alone: no communicator is opened
    transport._links = {5: [_Placeholder(f"comm {k}") for k in range(comms)]}  # type: ignore[misc]
    transport._sent, transport._received = {}, {}
    return transport


LARGE = torch.empty(SMALL_OP_BYTES + 1, dtype=torch.uint8)
SMALL = torch.empty(SMALL_OP_BYTES, dtype=torch.uint8)


def test_a_control_exchange_takes_the_first_communicator_and_restarts_the_rotation():
    transport = _placeholder_transport(3)
    tensor = LARGE
    steps = []
    for _ in range(2):  # a step: the header both ways, then 4 data sends and 2 data receives, one at a time
        step = _comms_of(transport, [(5, tensor)], [(5, tensor)], control=True)
        for _ in range(4):
            step += _comms_of(transport, [(5, tensor)], [])
        for _ in range(2):
            step += _comms_of(transport, [], [(5, tensor)])
        steps.append(step)
    # 4 sends over 3 communicators: without the restart the second step's would start on comm 1
    assert steps[0] == steps[1] == [("comm 0", "send"), ("comm 0", "recv"), ("comm 0", "send"), ("comm 1", "send"),
                                    ("comm 2", "send"), ("comm 0", "send"), ("comm 0", "recv"), ("comm 1", "recv")]
    assert transport._sent == {5: 4} and transport._received == {5: 2}


def test_a_small_operation_rides_with_the_one_before_so_large_ones_still_alternate():
    """A step of FP8 messages, each its values then its scales: the values alternate over 2 communicators,
    each message's scales follow its values."""
    transport = _placeholder_transport(2)
    step = _comms_of(transport, [(5, SMALL)], [], control=True)
    for _ in range(3):
        step += _comms_of(transport, [(5, LARGE), (5, SMALL)], [])
    step += _comms_of(transport, [(5, SMALL)], [])  # a small one alone still goes on a communicator
    sends = [comm for comm, _ in step[1:]]
    assert sends == ["comm 0", "comm 0", "comm 1", "comm 1", "comm 0", "comm 0", "comm 0"]
    assert transport._sent == {5: 3}


def test_pairwise_mode_counts_the_communicators_each_gpu_holds():
    # TP2 -> TP1 x DP2 with two ranks per GPU: every rank has two peers on the other GPU
    assert pairwise_comms_per_gpu(["a", "a", "b", "b"], 4) == 16 > PAIRWISE_COMMS_PER_GPU
    assert pairwise_comms_per_gpu(["a", "a", "b", "b"], 2) == PAIRWISE_COMMS_PER_GPU
    # one trainer rank on its own GPU, three engine ranks on another: the trainer's GPU holds 3 pairs' worth
    assert pairwise_comms_per_gpu(["t", "e", "e", "e"], 4) == 12
    assert pairwise_comms_per_gpu(["a", "a"], 4) == 0
