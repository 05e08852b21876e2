"""The rendezvous as an attacker and an unlucky operator meet it: pickles, foreign jobs, wrong
secrets, programs that are not refit, silent listeners, ranks that die or fail during setup."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fault_ranks import exit_during_setup_rank, planner_dies_rank, setup_rank, tampered_plan_rank, transport_fails_rank
from harness import ENV, Ranks

from refit_core.contract.errors import AuthenticationError, RefitError, RendezvousError
from refit_core.kit.launch import free_port
from refit_core.net.auth import JobCredentials
from refit_core.net.rendezvous import Rendezvous

HERE = Path(__file__).parent


def _listening_address(port: int) -> str:
    """The local address a socket listens on for ``port``, from /proc/net/tcp (hex, as the kernel writes it)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":  # LISTEN
            return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    raise AssertionError(f"nothing listens on port {port}")


def test_the_store_listens_only_on_the_interface_it_was_given():
    port = free_port()
    rdv = Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=10)
    try:
        assert _listening_address(port) == "127.0.0.1"
        with pytest.raises(ConnectionRefusedError):  # another address of this host: nobody there
            socket.create_connection(("127.0.0.2", port), timeout=2)
    finally:
        rdv.close()


def _attack(port: int, marker: Path, secret: str | None = None) -> str:
    args = [sys.executable, str(HERE / "attacker.py"), str(port), str(marker)] + ([secret] if secret else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=240, env={**os.environ, **ENV})
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_a_pickle_written_into_the_store_never_runs(tmp_path, monkeypatch):
    """The issue's attack, both ways: with a secret the attacker cannot write at all and the refit
    completes bitwise; opted out of the secret (``insecure``) it can write (as a rank of the job), and
    the ranks fail naming bad data. Nothing runs."""
    marker = tmp_path / "pwned"
    for secret in ("s3cret", None):
        port = free_port()
        address = f"127.0.0.1:{port}"
        options = {"secret": secret, "timeout_s": 120} if secret else {"insecure": True, "timeout_s": 120}
        if not secret:
            monkeypatch.delenv("REFIT_SECRET")  # the suite's (tests/conftest.py) would win over the opt-out
        ranks = Ranks()
        try:
            for rank in range(2):  # the train side, waiting for the gen side
                ranks.start(setup_rank, rank, address, 2, 1, options)
            ranks.release()
            _wait_listening(port)
            log = _attack(port, marker)
            if secret:
                assert "tcpstore: refused" in log and "raw: dropped" in log, log
                assert "no secret: refused (AuthenticationError" in log, log
                ranks.start(setup_rank, 2, address, 2, 1, options)
                results = ranks.wait_for([(r, "result") for r in range(3)], timeout_s=120)
                assert all(r["ok"] and r["bitwise"] for r in results.values()), results
            else:  # its made-up identity (train/7) is refused once the train side's size is out; a real one is not
                assert "no secret: wrote" in log or "train rank 7 is not a rank of this refit job" in log, log
                _write_pickle(port, marker, "gen/0")
                results = ranks.wait_for([(r, "result") for r in range(2)], timeout_s=60)
                for r in results.values():
                    assert "not refit data" in r["message"], r  # failed on the data, not at the deadline
        finally:
            ranks.close()
        time.sleep(0.5)
        assert not marker.exists(), "the pickle ran"


def _write_pickle(port: int, marker: Path, who: str) -> None:
    """What attacker.py writes, as a rank the job has not seen yet (possible without a secret)."""
    import pickle

    from attacker import Payload

    from refit_core.net.store import Endpoint, StoreClient

    evil = pickle.dumps(Payload(str(marker)))
    client = StoreClient(Endpoint("127.0.0.1", port), JobCredentials(), who, timeout_s=5, handshake_s=3)
    for key in ("error", "meta/gen/0", "size/gen"):
        client.set(key, evil)
    client.close()


def _wait_listening(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _listening_address(port)
            return
        except AssertionError:
            time.sleep(0.1)
    raise AssertionError(f"nobody listens on {port}")


@pytest.mark.slow
def test_a_second_job_on_a_busy_port_gets_named_errors_and_the_first_job_is_untouched():
    port = free_port()
    address = f"127.0.0.1:{port}"
    ranks = Ranks()
    try:
        ranks.start(setup_rank, 0, address, 1, 1, {"job": "job-a", "timeout_s": 120}, 2)  # job A's train side, waiting
        ranks.release()
        _wait_listening(port)
        ranks.start(setup_rank, 10, address, 1, 1, {"job": "job-b", "timeout_s": 120}, 2, 10)  # job B's train rank 0
        ranks.start(setup_rank, 11, address, 1, 1, {"job": "job-b", "timeout_s": 120}, 2, 10)  # job B's gen rank 0
        b = ranks.wait_for([(10, "result"), (11, "result")], timeout_s=120)
        ranks.start(setup_rank, 1, address, 1, 1, {"job": "job-a", "timeout_s": 120}, 2)  # job A's gen rank
        a = ranks.wait_for([(0, "result"), (1, "result")], timeout_s=120)
    finally:
        ranks.close()
    host, gen = b[(10, "result")], b[(11, "result")]
    assert host["error"] == "RendezvousError" and "could not host" in host["message"], host
    assert gen["error"] == "AuthenticationError" and "is another refit job's (its store started at" in gen["message"]
    assert "job names differ" in gen["message"], gen
    assert "job-a" not in gen["message"], gen  # a refusal keeps the job's name to itself
    assert "job-b" in gen["message"] and gen["seconds"] < 15, gen
    assert all(r.get("ok") and r["bitwise"] for r in a.values()), a


def test_a_wrong_secret_is_refused_before_it_reads_or_writes():
    port = free_port()
    host = Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=60,
                      credentials=JobCredentials("job", b"right"))
    try:
        host.publish("meta/train/0", [])
        start = time.monotonic()
        with pytest.raises(AuthenticationError, match="wrong secret|could not prove"):
            Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=60,
                       credentials=JobCredentials("job", b"wrong"))
        assert time.monotonic() - start < 30  # refused at once, not at the 60 s deadline (margin for a busy box)
        assert host.client.num_keys() == 1 and host.read("meta/train/0") == []
    finally:
        host.close()


def test_a_rank_joining_twice_fails_the_setup_instead_of_mixing_two_jobs():
    port = free_port()
    host = Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=10)
    first = Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=10)
    try:
        with pytest.raises(RendezvousError, match="gen rank 0 joined the refit rendezvous twice"):
            Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=10)
        with pytest.raises(RendezvousError, match="joined the refit rendezvous twice"):
            first.wait(["meta/gen/0"], "gen metadata")
    finally:
        first.close()
        host.close()


def test_the_agreement_barrier_waits_for_every_rank_and_names_the_missing_ones_at_its_deadline():
    port = free_port()
    host = Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=1)
    gen = Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=1)
    keys = ["fingerprint/train/0", "fingerprint/gen/0", "fingerprint/gen/1"]
    try:
        for rdv, key in ((host, keys[0]), (gen, keys[1])):
            rdv.publish(key, "abc")
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (gen.barrier("agreed", 2, keys[:2], "agreement"), done.set()))
        waiter.start()
        host.barrier("agreed", 2, keys[:2], "agreement")  # both arrived: both pass
        waiter.join(timeout=10)
        assert done.is_set()
        with pytest.raises(RefitError, match="waiting for agreement: gen rank 1 did not arrive"):
            host.barrier("again", 2, keys, "agreement")  # gen rank 1 never publishes nor arrives
    finally:
        gen.close()
        host.close()


def test_a_program_that_is_not_refit_is_dropped_and_the_store_keeps_serving():
    port = free_port()
    host = Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=10)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert raw.recv(100) == b""  # closed without an answer
        client = Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=10)
        client.publish("x", 1)
        assert host.read("x") == 1
        client.close()
    finally:
        host.close()


def _silent_listener(port: int, stop: threading.Event) -> socket.socket:
    server = socket.create_server(("127.0.0.1", port))
    held = []

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])  # accept, never answer
            except OSError:
                pass
    threading.Thread(target=accept, daemon=True).start()
    return server


def test_a_silent_listener_on_the_port_is_named_within_seconds():
    port = free_port()
    stop = threading.Event()
    server = _silent_listener(port, stop)
    try:
        start = time.monotonic()
        with pytest.raises(RendezvousError, match="did not answer refit's greeting"):
            Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=60, handshake_s=2)
        assert time.monotonic() - start < 30  # the 2 s handshake ended it, not the 60 s deadline
        with pytest.raises(RendezvousError, match="could not host .* did not answer .* or another program"):
            Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=60)
    finally:
        stop.set()
        server.close()


def _closing_listener(port: int, stop: threading.Event) -> threading.Thread:
    """Accepts and closes every connection without a word, as a refit store does while it closes,
    until ``stop``; then stops listening (join the thread to know the port is free)."""
    server = socket.create_server(("127.0.0.1", port))
    server.settimeout(0.2)

    def accept():
        with server:
            while not stop.is_set():
                try:
                    server.accept()[0].close()
                except OSError:
                    pass
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return thread


def test_a_listener_that_closes_without_answering_is_named_after_the_grace_for_a_replaced_store():
    port = free_port()
    stop = threading.Event()
    listener = _closing_listener(port, stop)
    try:
        start = time.monotonic()
        with pytest.raises(RendezvousError, match="does not speak refit's rendezvous protocol .* another program"):
            Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=60, handshake_s=2)
        assert 2 <= time.monotonic() - start < 30  # after the 2 s grace, long before the 60 s deadline
    finally:
        stop.set()
        listener.join()


def test_a_rank_joining_while_the_previous_store_closes_waits_for_its_replacement():
    """Between two setups on one port the old store closes connections it had not yet accepted; a
    rank connecting then must join the replacement, not call the port foreign."""
    port = free_port()
    stop = threading.Event()
    listener = _closing_listener(port, stop)
    joined: list[object] = []

    def join():
        try:
            client = Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=30, handshake_s=5)
            joined.append(client.read("x"))
            client.close()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            joined.append(exc)

    thread = threading.Thread(target=join)
    thread.start()
    time.sleep(1.0)  # the rank has been turned away for a second
    stop.set()
    listener.join()
    host = Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=30)
    try:
        host.publish("x", 7)
        thread.join(timeout=30)
        assert joined == [7], joined
    finally:
        host.close()


@pytest.mark.slow
def test_a_transport_that_fails_to_open_on_one_rank_stops_every_rank_at_once():
    address = f"127.0.0.1:{free_port()}"
    ranks = Ranks()
    try:
        ranks.start(setup_rank, 0, address, 1, 2, {"timeout_s": 60})
        ranks.start(setup_rank, 1, address, 1, 2, {"timeout_s": 60})
        ranks.start(transport_fails_rank, 2, address, 1, 2, {"timeout_s": 60})
        ranks.release()
        results = ranks.wait_for([(r, "result") for r in range(3)], timeout_s=120)
    finally:
        ranks.close()
    for r in results.values():
        assert "transport did not open: injected: gloo could not" in r["message"] and r["seconds"] < 30, r


@pytest.mark.slow
def test_a_rank_that_dies_during_setup_is_named_within_seconds():
    address = f"127.0.0.1:{free_port()}"
    ranks = Ranks()
    try:
        ranks.start(setup_rank, 0, address, 1, 1, {"timeout_s": 60})
        ranks.start(exit_during_setup_rank, 1, address, 1, 1, {})
        ranks.release()
        (result,) = ranks.wait_for([(0, "result")], timeout_s=120).values()
    finally:
        ranks.close()
    assert result["error"] == "RendezvousError" and "gen rank 0 left the refit" in result["message"]
    assert result["seconds"] < 30, result


@pytest.mark.slow
def test_a_plan_that_does_not_fit_a_ranks_pieces_fails_every_rank_before_any_collective():
    address = f"127.0.0.1:{free_port()}"
    ranks = Ranks()
    try:
        for r in range(3):
            ranks.start(tampered_plan_rank if r == 2 else setup_rank, r, address, 1, 2, {"timeout_s": 60})
        ranks.release()
        results = ranks.wait_for([(r, "result") for r in range(3)], timeout_s=120)
    finally:
        ranks.close()
    for r in results.values():  # gen rank 1 refused its part; everyone hears why, naming the tensor
        assert r["error"] == "PlanError", r
        assert "gen rank 1: the plan was made for " in r["message"] and "torch.float16" in r["message"], r
        assert r["seconds"] < 30, r


@pytest.mark.slow
def test_ranks_waiting_for_a_planner_that_died_get_a_named_error_within_seconds():
    address = f"127.0.0.1:{free_port()}"
    ranks = Ranks()
    try:
        ranks.start(planner_dies_rank, 0, address, 2, 2, {"timeout_s": 60})
        for r in range(1, 4):
            ranks.start(setup_rank, r, address, 2, 2, {"timeout_s": 60})
        ranks.release()
        results = ranks.wait_for([(r, "result") for r in range(1, 4)], timeout_s=120)
    finally:
        ranks.close()
    for r in results.values():
        assert r["error"] == "RendezvousError" and "train rank 0 hosts it" in r["message"], r
        assert r["seconds"] < 30, r


def test_a_rank_that_hears_of_another_ranks_failure_also_names_what_it_still_waited_for():
    """The planner waits for a train rank that never comes; a gen rank gives up first (its own deadline, on
    its part of the plan). The planner's error must still name the rank that never came: the root cause."""
    port = free_port()
    host = Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=10)
    gen = Rendezvous(f"127.0.0.1:{port}", host=False, who="gen/0", timeout_s=10)
    try:
        host.publish("meta/train/0", "abc")
        gen.fail(RefitError("timed out waiting for gen rank 0's part of the plan"), "gen rank 0", "done/gen/0")
        with pytest.raises(RefitError) as caught:
            host.wait(["meta/train/0", "meta/train/1"], "train metadata")
        message = str(caught.value)
        assert message.startswith("refit setup failed on another rank: gen rank 0: timed out waiting for gen "
                                  "rank 0's part of the plan"), message
        assert message.endswith("; this rank was still waiting for train metadata: train rank 1 did not arrive"), \
            message
    finally:
        gen.close()
        host.close()
