"""The rendezvous store, safe by default: refusals that keep the job's name, limits on what an
authenticated rank may store (each a named error, the store serving on), identities that must be
ranks of the job, a nesting-depth limit on JSON, frames tagged per connection so that a relay on the
path can neither inject nor replay, and a warning when no secret is set."""

import base64
import json
import logging
import socket
import struct
import threading
import time

import pytest

from refit_core.contract.errors import AuthenticationError, RendezvousError, WireError
from refit_core.contract.options import RefitOptions, StoreLimits
from refit_core.contract.side import Side
from refit_core.kit.launch import free_port
from refit_core.net import auth, wire
from refit_core.net.auth import PROTOCOL, JobCredentials, SessionMac, new_nonce
from refit_core.net.keys import size_key
from refit_core.net.rendezvous import Rendezvous
from refit_core.net.wire import recv_frame, send_frame

SECRET = JobCredentials("job-7", b"s3cret")


def _host(port: int, limits: StoreLimits | None = None, credentials: JobCredentials = SECRET) -> Rendezvous:
    return Rendezvous(f"127.0.0.1:{port}", host=True, who="train/0", timeout_s=10, credentials=credentials,
                      limits=limits)


def _rank(port: int, who: str = "gen/0", credentials: JobCredentials = SECRET) -> Rendezvous:
    return Rendezvous(f"127.0.0.1:{port}", host=False, who=who, timeout_s=10, credentials=credentials,
                      handshake_s=3)


def _join_raw(port: int, credentials: JobCredentials, who: str) -> tuple[socket.socket, SessionMac]:
    """Join as a rank by hand (an insider's program): the socket and its frame tags."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=3)
    nonce = new_nonce()
    send_frame(sock, {"protocol": PROTOCOL, "job": credentials.job, "who": who, "nonce": nonce})
    hello = recv_frame(sock, 4096, "the host")
    send_frame(sock, {"proof": credentials.proof("rank", who, nonce, hello["nonce"])})
    verdict = recv_frame(sock, 4096, "the host")
    assert verdict.get("ok") is True, verdict
    return sock, credentials.session("rank", who, nonce, hello["nonce"])


def test_a_foreign_job_is_refused_without_learning_the_jobs_name():
    port = free_port()
    host = _host(port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as raw:
            send_frame(raw, {"protocol": PROTOCOL, "job": "curious", "who": "gen/0", "nonce": new_nonce()})
            refusal = recv_frame(raw, 4096, "the host")
            assert refusal.pop("refused") == "foreign_job" and set(refusal) == {"started"}  # nothing of the job
        with pytest.raises(AuthenticationError, match=r"another refit job's \(its store started at .*; job names "
                                                      r"differ\)") as info:
            _rank(port, credentials=JobCredentials("curious", b"s3cret"))
        assert "job-7" not in str(info.value)
    finally:
        host.close()


def test_values_bytes_and_keys_over_the_limits_are_named_errors_and_the_store_keeps_serving():
    port = free_port()
    host = _host(port, StoreLimits(max_value_bytes=4096, max_stored_bytes=12_000, max_keys=8))
    gen = _rank(port)
    try:
        with pytest.raises(RendezvousError, match=r"value of 5000 bytes under 'big'.*max_value_bytes"):
            gen.client.set("big", b"x" * 5000)
        for i in range(2):
            gen.client.set(f"v{i}", b"x" * 4000)
        with pytest.raises(RendezvousError, match=r"max_stored_bytes"):
            gen.client.set("v2", b"x" * 4000)
        gen.client.set("v1", b"y" * 4000)  # replacing a value counts the difference only
        assert gen.client.delete_key("v1")  # deleting frees its bytes
        gen.client.set("v2", b"z" * 4000)
        for i in range(8 - gen.client.num_keys()):
            gen.client.set(f"k{i}", b"1")
        with pytest.raises(RendezvousError, match=r"max_keys"):
            gen.client.set("one-too-many", b"1")
        gen.client.set("k0", b"2")  # an existing key may still change
        with pytest.raises(RendezvousError, match=r"max_keys"):
            gen.client.add("counter", 1)
        assert host.client.try_get("v2") == b"z" * 4000 and host.client.try_get("k0") == b"2"
    finally:
        gen.close()
        host.close()


def test_the_default_limits_hold_a_large_plan_and_refuse_a_gigabyte_request():
    limits = RefitOptions().store
    assert limits.max_value_bytes >= 50 * 4_840_577  # the largest part of a 1032-rank plan, 50 times over
    assert limits.max_stored_bytes >= 10 * 180_000_000  # what a 1032-rank setup stores, 10 times over
    port = free_port()
    host = _host(port)
    try:
        sock, _ = _join_raw(port, SECRET, "gen/0")
        with sock:
            sock.sendall(struct.pack(">I", 1 << 30))  # announces a 1 GiB request: dropped before it is read
            assert sock.recv(1) == b""
        gen = _rank(port, "gen/1")
        gen.publish("x", 1)
        assert host.read("x") == 1
        gen.close()
    finally:
        host.close()


def test_only_ranks_of_the_job_may_join():
    port = free_port()
    host = _host(port, StoreLimits(max_rank=100))
    try:
        with pytest.raises(RendezvousError, match=r"'admin' is not a refit rank's identity"):
            _rank(port, "admin")
        with pytest.raises(RendezvousError, match=r"train rank 100 is not a rank of this refit job.*max_rank=100"):
            _rank(port, "train/100")
        host.publish(size_key(Side.GEN), 2)
        with pytest.raises(RendezvousError, match=r"gen rank 2 is not a rank of this refit job: the gen side has 2"):
            _rank(port, "gen/2")
        member = _rank(port, "gen/1")
        member.close()
        assert host.client.gone() == []  # nobody refused left a trace
    finally:
        host.close()


def test_deeply_nested_values_are_wire_errors_not_recursion_errors():
    port = free_port()
    host = _host(port)
    gen = _rank(port)
    try:
        gen.client.set("meta/gen/0", b"[" * 100_000 + b"]" * 100_000)
        with pytest.raises(WireError, match=r"gen metadata \(meta/gen/0\): not refit data \(nested more than 32"):
            host.wait(["meta/gen/0"], "gen metadata")
    finally:
        gen.close()
        host.close()
    deepest = b"[" * wire.MAX_DEPTH + b"]" * wire.MAX_DEPTH
    assert wire.decode(deepest, "x") is not None
    with pytest.raises(WireError, match="nested more than"):
        wire.decode(b"[" + deepest + b"]", "x")
    quoted = json.dumps(["[[[{" * 40, '\\"[[[' * 20, {"k": [1, 2]}]).encode()  # brackets in strings do not count
    assert wire.decode(quoted, "x")[2] == {"k": [1, 2]}
    assert wire.nested_deeper_than(json.dumps([[["a\"b"] * 40]]).encode(), 2)


def test_nested_json_before_authentication_is_dropped_quietly(monkeypatch):
    raised: list[object] = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    port = free_port()
    host = _host(port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as raw:
            body = b"[" * 1000 + b"]" * 1000
            raw.sendall(struct.pack(">I", len(body)) + body)
            assert raw.recv(1) == b""
        time.sleep(0.3)  # a thread's uncaught exception reaches the hook after its socket closed
        assert raised == []
        assert _rank(port).read("nothing") is None  # still serving
    finally:
        host.close()


class _Relay:
    """A TCP relay between one rank and the store that can inject bytes either way and records what
    the rank sent (to replay it)."""

    def __init__(self, target: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.target = target
        self.from_rank = bytearray()
        self.to_host: socket.socket | None = None
        self.to_rank: socket.socket | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.to_rank, _ = self._listener.accept()
        self.to_host = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(self.to_host, self.to_rank, None), daemon=True).start()
        self._pump(self.to_rank, self.to_host, self.from_rank)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if record is not None:
                    record += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        for sock in (self.to_host, self.to_rank):
            if sock is not None:
                sock.close()


def _forged(value: object) -> bytes:
    body = json.dumps(value).encode()
    return struct.pack(">I", len(body)) + body + b"\0" * SessionMac.tag_bytes


def _wait_gone(host: Rendezvous, who: str) -> list[str]:
    deadline = time.monotonic() + 5
    while (gone := host.client.gone()) != [who] and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone


def test_a_request_injected_by_a_relay_is_refused():
    port = free_port()
    host = _host(port)
    relay = _Relay(port)
    gen = _rank(relay.port)
    try:
        gen.publish("x", 1)
        assert relay.to_host is not None
        relay.to_host.sendall(_forged({"op": "set", "key": "error", "value": base64.b64encode(b"{}").decode()}))
        assert _wait_gone(host, "gen/0") == ["gen/0"]  # its connection was dropped
        assert host.client.try_get("error") is None and host.read("x") == 1
    finally:
        relay.close()
        host.close()


def test_an_answer_injected_by_a_relay_is_a_named_error():
    port = free_port()
    host = _host(port)
    relay = _Relay(port)
    gen = _rank(relay.port)
    try:
        gen.publish("x", 1)
        assert relay.to_rank is not None
        relay.to_rank.sendall(_forged({"ok": True}))
        with pytest.raises(RendezvousError, match=r"sent a bad answer: .*failed its authentication \(HMAC\)"):
            gen.client.try_get("x")
        with pytest.raises(RendezvousError, match=r"failed its authentication"):  # and stays dropped
            gen.client.try_get("x")
    finally:
        gen.close()
        relay.close()
        host.close()


def test_a_request_replayed_by_a_relay_is_refused():
    port = free_port()
    host = _host(port)
    relay = _Relay(port)
    gen = _rank(relay.port)
    try:
        gen.publish("x", 1)
        mark = len(relay.from_rank)
        assert gen.client.add("count", 1) == 1
        assert relay.to_host is not None
        relay.to_host.sendall(bytes(relay.from_rank[mark:]))  # the same request, word for word
        assert _wait_gone(host, "gen/0") == ["gen/0"]
        assert host.client.add("count", 0) == 1
    finally:
        relay.close()
        host.close()


def test_a_job_without_a_secret_warns_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(auth, "_warned", threading.Event())
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="refit"):
        host = _host(port, credentials=JobCredentials("open-job"))
        gen = _rank(port, credentials=JobCredentials("open-job"))
        gen.close()
        host.close()
    warnings = [r.getMessage() for r in caplog.records if "without a secret" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "every local process" in warnings[0] and "REFIT_SECRET" in warnings[0] and "open-job" in warnings[0]
    monkeypatch.setattr(auth, "_warned", threading.Event())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="refit"):
        _host(free_port()).close()
    assert not [r for r in caplog.records if "without a secret" in r.getMessage()]


def test_store_limits_are_train_rank_0s_own_setting_outside_the_fingerprint():
    mine = RefitOptions(store={"max_keys": 5})
    assert mine.store == StoreLimits(max_keys=5) and mine.explicit == {"store.max_keys"}
    adopted = mine.agree_with(RefitOptions(num_buffers=2, store={"max_keys": 9}), "gen rank 1")
    assert adopted.store.max_keys == 5 and adopted.num_buffers == 2  # no disagreement: each rank's own
    assert mine.resolved("cpu").digest() == RefitOptions().resolved("cpu").digest()
    assert RefitOptions.from_wire(mine.to_wire()).store == mine.store
    with pytest.raises(ValueError, match=r"StoreLimits\(max_value_bytes=0.*each must be >= 1"):
        StoreLimits(max_value_bytes=0)
