"""The gloo transport's watch, in one process: a wait on a peer that will never complete ends within
about a second once the store says the peer is gone or a rank gave up, naming it; a transport closed
with messages in flight tells the others. Two real gloo transports (threads) on an in-memory store."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from refit_core.contract.errors import TransferError
from refit_core.contract.side import Side
from refit_core.apps import same_bytes
from refit_core.net.keys import gone_key
from refit_core.net.transport.gloo import GlooTransport
from refit_core.net.keys import TRANSPORT_FAILED
from refit_core.net.transport.watch import StoreWatch

SIZES = {Side.TRAIN: 1, Side.GEN: 1}  # global rank 0 is train rank 0, rank 1 gen rank 0
MIB = 1 << 20
SEEN_WITHIN_S = 3.0  # the watch's first check comes after 0.25 s, the next within a second
DEADLINE_S = 20


def _pair(store: dist.Store) -> list[GlooTransport]:
    transports: list[GlooTransport | None] = [None, None]

    def open_one(rank: int) -> None:
        transports[rank] = GlooTransport(store, rank, 2, DEADLINE_S, StoreWatch(store, SIZES), "127.0.0.1")

    threads = [threading.Thread(target=open_one, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(t is not None for t in transports)
    return transports  # type: ignore[return-value]


def _later(seconds: float, action) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["gone", "gave_up"])
def test_a_slow_wait_ends_once_the_store_reports_the_peer_lost(how):
    store = dist.HashStore()
    receiver, sender = _pair(store)
    try:
        fence = receiver.exchange([], [(1, torch.empty(MIB, dtype=torch.uint8))])  # rank 1 never sends
        if how == "gone":
            _later(0.5, lambda: store.set(gone_key("gen/0"), "closed"))
        else:
            _later(0.5, lambda: sender.watch.give_up(1, "injected: its engine failed"))
        start = time.monotonic()
        with pytest.raises(TransferError) as caught:
            fence.synchronize(DEADLINE_S)
        assert time.monotonic() - start < SEEN_WITHIN_S
        expected = "is gone" if how == "gone" else "gave up on the step: injected: its engine failed"
        assert f"rank 1 (gen rank 0) {expected}" in str(caught.value), caught.value
        with pytest.raises(TransferError, match="gave up on a step"):
            receiver.exchange([], [(1, torch.empty(4))])  # nothing more is posted
    finally:
        receiver.close()
        sender.close()


def test_closing_with_messages_in_flight_tells_the_others_and_a_finished_step_does_not():
    store = dist.HashStore()
    a, b = _pair(store)
    try:
        data = torch.arange(MIB, dtype=torch.float32)
        fences = [a.exchange([(1, data)], []), b.exchange([], [(0, received := torch.zeros(MIB))])]
        for fence in fences:
            fence.synchronize(DEADLINE_S)
        assert same_bytes(received, data) and not store.check([TRANSPORT_FAILED])
        a.exchange([], [(1, torch.empty(MIB))])  # rank 1 will never send it
    finally:
        a.close()
        b.close()
    assert store.get(TRANSPORT_FAILED).decode().startswith("0 rank 0 closed its transport with messages in flight")


_EXIT_AFTER_ABANDONING = """
import atexit, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
import test_inflight_watch as t
from refit_core.net.transport import gloo
if sys.argv[1] == "without-the-exit-hook":
    atexit.unregister(gloo._let_parked_waits_end)
t.DEADLINE_S = 3  # gloo releases the abandoned recv 3 s after it was posted
store = dist.HashStore()
receiver, sender = t._pair(store)
fence = receiver.exchange([], [(1, torch.empty(t.MIB, dtype=torch.uint8))])  # rank 1 never sends
t._later(0.3, lambda: sender.watch.give_up(1, "injected"))
try:
    fence.synchronize(t.DEADLINE_S)
except Exception as exc:
    print("abandoned:", type(exc).__name__, flush=True)

class SlowFinalization:  # keeps the interpreter finalizing while gloo releases the helper
    def __del__(self, sleep=time.sleep):  # module globals are gone by then
        sleep(2)

keep = SlowFinalization()
"""


@pytest.mark.parametrize("hook", ["with-the-exit-hook", "without-the-exit-hook"])
def test_a_process_ends_cleanly_while_gloo_still_holds_a_wait_it_abandoned(hook, tmp_path):
    """The helper wakes while the interpreter finalizes: without the exit hook the process aborts."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit_after_abandoning.py"
    script.write_text(_EXIT_AFTER_ABANDONING.format(tests=str(Path(__file__).parent)))
    out = subprocess.run([sys.executable, str(script), hook], capture_output=True, text=True, timeout=60)
    assert "abandoned: TransferError" in out.stdout, out.stdout + out.stderr
    if hook == "with-the-exit-hook":
        assert out.returncode == 0, out.stderr
        assert "ends once gloo releases a transfer it abandoned" in out.stderr
    else:  # the crash the hook prevents (it shows the test reproduces it)
        assert out.returncode != 0 and "terminate called" in out.stderr, (out.returncode, out.stderr)


def test_an_unreachable_store_dooms_a_wait_on_its_host_at_once_and_others_after_a_grace():
    """A trainer may end right after its last send: its store going away dooms a wait on train rank 0 at
    once, and a wait on another rank (whose messages may still be arriving) only after a grace."""
    from refit_core.kit.launch import free_port
    from refit_core.net.auth import JobCredentials
    from refit_core.net.rendezvous import Rendezvous

    port, credentials = free_port(), JobCredentials("job", b"secret")
    host = Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=10, credentials=credentials)
    rank = Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=10, credentials=credentials)
    watch = StoreWatch(rank.client, {Side.TRAIN: 2, Side.GEN: 1}, store_loss_grace_s=0.5)
    try:
        assert watch.lost(1) is None and watch.lost(0) is None
        host.close()
        assert watch.lost(1) is None  # train rank 1's messages may still arrive
        loss = watch.lost(0)
        assert loss is not None and loss.rank == 0 and "hosts the rendezvous, which is unreachable" in loss.reason
        time.sleep(0.6)
        late = watch.lost(1)
        assert late is not None and late.rank == 0, late
    finally:
        rank.close()
