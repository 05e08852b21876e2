"""A stopped (SIGSTOP) store host, train rank 0, with real processes: every survivor gets a named
``RendezvousError`` within its deadline plus a margin, and ``close()`` returns within seconds, during
setup, during a staged step and after an in-place step; never a hang until the host is killed."""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fault_ranks import Fault, Scenario, run_rank, setup_rank
from harness import ENV, Ranks

from refit_core.contract.errors import RendezvousError
from refit_core.kit.launch import free_port
from refit_core.net.rendezvous import Rendezvous
from refit_core.net.store import CLOSE_S

TIMEOUT_S = 3
HOST = """
import sys, time
from refit_core.net.rendezvous import Rendezvous
rdv = Rendezvous(sys.argv[1], host=True, who="train/0", timeout_s=60)
rdv.publish("ready", 1)
print("ready", flush=True)
time.sleep(600)
"""


def _in_thread(fn, out: dict, name: str) -> threading.Thread:
    def run():
        start = time.monotonic()
        try:
            fn()
            out[name] = ("returned", time.monotonic() - start, "")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[name] = (type(exc).__name__, time.monotonic() - start, str(exc))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _until_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until process ``pid`` is stopped (state ``T`` in ``/proc/PID/stat``), not merely signalled."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s of SIGSTOP")


@contextmanager
def store_host(address: str) -> Iterator[subprocess.Popen]:
    """A process hosting a store at ``address`` (:data:`HOST`), ready when this yields; killed on exit."""
    host = subprocess.Popen([sys.executable, "-c", HOST, address], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV})
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "ready"
        yield host
    finally:
        host.kill()
        host.wait()


def test_a_stopped_store_host_is_named_on_every_request_and_close_stays_bounded():
    address = f"127.0.0.1:{free_port()}"
    with store_host(address) as host:
        waiting = Rendezvous(address, host=False, who="gen/0", timeout_s=TIMEOUT_S)
        publisher = Rendezvous(address, host=False, who="gen/1", timeout_s=TIMEOUT_S)
        quiet = Rendezvous(address, host=False, who="gen/2", timeout_s=TIMEOUT_S)
        assert publisher.read("ready") == 1
        out: dict[str, tuple[str, float, str]] = {}
        threads = [_in_thread(lambda: waiting.wait(["never"], "a key nobody writes"), out, "wait")]
        time.sleep(0.5)
        os.kill(host.pid, signal.SIGSTOP)
        _until_stopped(host.pid)  # on a loaded machine the host may run on for a moment and answer
        threads.append(_in_thread(lambda: publisher.publish("x", 1), out, "publish"))
        for thread in threads:
            thread.join(timeout=3 * TIMEOUT_S)
        for name in ("wait", "publish"):
            kind, seconds, message = out.get(name, ("still blocked", 0.0, ""))
            assert kind == "RendezvousError", (name, kind, message)
            assert "did not answer within" in message and "stopped, hung or overloaded" in message, message
            assert "train rank 0 hosts it" in message and seconds < TIMEOUT_S + 2, (name, seconds)
        with pytest.raises(RendezvousError, match="did not answer within"):  # the dropped connection says why
            publisher.publish("y", 1)
        names = ("close waiting", "close publisher", "close quiet")  # quiet's goodbye: nobody answers
        threads = [_in_thread(rdv.close, out, name) for name, rdv in zip(names, (waiting, publisher, quiet))]
        for thread in threads:
            thread.join(timeout=3 * CLOSE_S)
        for name in names:
            assert out.get(name, ("still blocked",))[0] == "returned", out
            assert out[name][1] < CLOSE_S + 1, out


def _planner_stops_rank(rank, report, address, train, gen, options):
    """Train rank 0 (the planner, hosting the store) stopping (SIGSTOP) itself while it plans."""
    import refit_core.endpoints.agreement as agreement

    def stops(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSTOP)
    agreement.plan_with_relay = stops
    return setup_rank(rank, report, address, train, gen, options)


@pytest.mark.slow
def test_ranks_waiting_for_a_stopped_planner_get_a_named_error_within_their_deadline():
    address = f"127.0.0.1:{free_port()}"
    ranks = Ranks()
    try:
        ranks.start(_planner_stops_rank, 0, address, 1, 1, {"timeout_s": TIMEOUT_S})
        ranks.start(setup_rank, 1, address, 1, 1, {"timeout_s": TIMEOUT_S})
        ranks.release()
        results = ranks.wait_for([(1, "result")], timeout_s=60)
    finally:
        ranks.close()
    for r in results.values():
        assert r["error"] == "RendezvousError", r
        assert "did not answer within" in r["message"] and "train rank 0 hosts it" in r["message"], r
        assert r["seconds"] < TIMEOUT_S + 3, r


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_store_host_stopped_mid_step_costs_the_survivors_their_deadline_not_a_hang(mode):
    """Train rank 0 stops inside the step's transfer; train rank 1 and the gen rank fail the step
    with a named error and close; their results (sent after close()) arrive within seconds. (The gen
    rank may still be reading step 0's decision when the host stops: then step 0 fails.)"""
    scenario = Scenario(2, 1, {"mode": mode, "timeout_s": TIMEOUT_S}, Fault(0, signal.SIGSTOP))
    ranks = Ranks()
    address = f"127.0.0.1:{free_port()}"
    try:
        for rank in range(3):
            ranks.start(run_rank, rank, address, scenario)
        ranks.release()
        ranks.wait_for([(2, "failed")], timeout_s=60)  # an in-place sender may finish its part: finding 4
        start = time.monotonic()
        results = ranks.wait_for([(1, "result"), (2, "result")], timeout_s=60)
        after_failing = time.monotonic() - start
    finally:
        ranks.close()
    gen = results[(2, "result")]
    assert "error" in gen, gen
    for rank, r in ((1, results[(1, "result")]), (2, gen)):
        if "error" in r:
            assert r["error"] in ("TransferError", "StepFailedError", "RendezvousError", "DecisionUnknown"), (rank, r)
            assert r["seconds"] < 2 * TIMEOUT_S + 3, (rank, r)  # the transport's deadline, then one store answer
    assert after_failing < 2 * TIMEOUT_S + 2 * CLOSE_S + 3, after_failing  # close() did not wait for the host
    if mode == "staged":  # old weights, or the rank refuses to serve (it could not learn the decision)
        assert "error" in results[(1, "result")], results
        assert set(gen["state"].values()) == {"old"} or gen["needs_refit"], gen
