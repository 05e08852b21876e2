"""refit's own key-value store: an authenticated TCP server on train rank 0 and a client on every rank.

Why not torch's ``TCPStore``: it listens on every interface whatever address it is given, lets any
client read and write without credentials, and refit used to pickle into it. This store

- binds only to the interface of the address it is given;
- speaks length-prefixed JSON (:mod:`refit_core.net.wire`); values are opaque bytes, never unpickled;
- runs a mutual HMAC handshake (:mod:`refit_core.net.auth`) before a client may read or write a key:
  a rank of another job, a wrong secret, a program that is not refit, or a listener that never
  answers get a named :class:`~refit_core.contract.errors.RendezvousError` within ``handshake_s`` (twice
  that for a listener that closes connections without a word, which a refit store closing between
  two setups on one port also does: its replacement gets ``handshake_s`` to appear);
- knows which rank each connection belongs to: a rank that joins twice is refused (two jobs on one
  port), and a rank whose connection closes without saying goodbye is recorded as *gone*, so the
  others stop waiting for it at once instead of at their deadline;
- stops admitting ranks once sealed (setup finished) or failed: a rank starting a new setup waits
  until the host starts a fresh store on the same port instead of joining a finished one.

:class:`StoreClient` is a ``torch.distributed.Store``, so gloo and NCCL build their communicators on it.
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from refit_core.contract.errors import AuthenticationError, RendezvousError
from refit_core.net.auth import PROTOCOL, JobCredentials, new_nonce
from refit_core.net.keys import RankRecord, rank_key, rank_name
from refit_core.net.wire import WireError, recv_frame, send_frame

log = logging.getLogger("refit")

HANDSHAKE_BYTES = 2048  # before a peer is authenticated it may not make us allocate more
MAX_FRAME_BYTES = 1 << 30
WAIT_SLICE_S = 0.25  # a blocking read returns this often so the client can check for failures
ERROR_KEY = "error"
GONE_PREFIX = "gone/"


@dataclass(frozen=True)
class Endpoint:
    """A parsed ``HOST:PORT``."""

    host: str
    port: int

    @classmethod
    def parse(cls, address: str) -> Endpoint:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise RendezvousError(f"rendezvous {address!r}: expected HOST:PORT")
        return cls(host.strip("[]") or "127.0.0.1", int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def _encode_value(value: bytes) -> str:
    return base64.b64encode(value).decode()


def _decode_value(value: Any) -> bytes:
    if not isinstance(value, str):
        raise WireError("a store value is not a string")
    return base64.b64decode(value, validate=True)


class StoreServer:
    """The store's host: one listening socket bound to ``endpoint``'s interface, a thread per client."""

    def __init__(self, endpoint: Endpoint, credentials: JobCredentials, *, handshake_s: float) -> None:
        self.endpoint = endpoint
        self.credentials = credentials
        self.handshake_s = handshake_s
        self.session = new_nonce()
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._members: dict[str, str] = {}  # rank identity -> peer address, while connected
        self._sealed = False
        self._closed = False
        self._connections: set[socket.socket] = set()
        try:
            infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            self._listener = socket.create_server(sockaddr, family=family, backlog=128)
        except OSError as exc:
            hint = (" (another program, perhaps another refit job, is using this port)"
                    if getattr(exc, "errno", None) == 98 else "")
            raise RendezvousError(f"could not host the refit rendezvous at {endpoint}: {exc}{hint}") from exc
        self._thread = threading.Thread(target=self._accept_loop, name="refit-store", daemon=True)
        self._thread.start()

    # -- state --------------------------------------------------------------------------------

    def seal(self) -> None:
        """Admit no more ranks (setup finished); connected ranks keep their connections."""
        with self._cond:
            self._sealed = True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            connections = list(self._connections)
            self._cond.notify_all()
        _shutdown(self._listener)  # shutdown wakes the accept() blocked in the server thread (Linux)
        for conn in connections:
            _shutdown(conn)
        self._thread.join(timeout=5)

    # -- connections --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            with self._cond:
                if self._closed:
                    _shutdown(conn)
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True,
                             name="refit-store-client").start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        who = None
        said_bye = False
        try:
            who = self._handshake(conn, peer)
            if who is None:
                return
            conn.settimeout(None)
            while True:
                request = recv_frame(conn, MAX_FRAME_BYTES, f"a request from {who}")
                if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                    raise WireError(f"malformed request from {who}")
                if request["op"] == "bye":
                    said_bye = True
                    send_frame(conn, {"ok": True})
                    return
                send_frame(conn, self._handle(request))
        except (OSError, ConnectionError, WireError, ValueError, TypeError, KeyError) as exc:
            log.debug("refit store: connection from %s (%s) ended: %s", peer, who, exc)
        finally:
            with self._cond:
                self._connections.discard(conn)
                if who is not None and self._members.get(who) == peer:
                    del self._members[who]
                    if not said_bye and not self._closed:
                        self._data[GONE_PREFIX + who] = b"its connection closed during setup or a step"
                        self._cond.notify_all()
            _shutdown(conn)

    def _handshake(self, conn: socket.socket, peer: str) -> str | None:
        """Authenticate a joining rank; its identity, or None after refusing it (with a reason)."""
        conn.settimeout(self.handshake_s)
        hello = recv_frame(conn, HANDSHAKE_BYTES, f"the greeting of {peer}")
        if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL:
            return None  # not refit: say nothing
        job, who, nonce = hello.get("job"), hello.get("who"), hello.get("nonce")
        if not (isinstance(job, str) and isinstance(who, str) and isinstance(nonce, str)):
            return None
        if not all(0 < len(v) <= 256 for v in (job, who, nonce)):
            return None
        if job != self.credentials.job:
            send_frame(conn, {"refused": "foreign_job", "job": self.credentials.job})
            return None
        with self._cond:  # a failed setup still admits the ranks that have not yet read its error
            busy = ("closed" if self._closed else "sealed" if self._sealed else
                    "failed" if ERROR_KEY in self._data and rank_key(RankRecord.DONE, who) in self._data else None)
        if busy:
            send_frame(conn, {"refused": "busy", "state": busy})
            return None
        mine = new_nonce()
        send_frame(conn, {"protocol": PROTOCOL, "nonce": mine,
                          "proof": self.credentials.proof("host", who, nonce, mine)})
        answer = recv_frame(conn, HANDSHAKE_BYTES, f"the proof of {peer}")
        if not isinstance(answer, dict) or not self.credentials.verify(answer.get("proof"), "rank", who, nonce, mine):
            send_frame(conn, {"refused": "wrong_secret"})
            log.warning("refit store: %s (claiming %s) failed to prove the job's secret", peer, who)
            return None
        with self._cond:
            holder = self._members.get(who)
            if holder is not None:
                message = (f"{rank_name(who)} joined the refit rendezvous twice (from {holder} "
                           f"and {peer}): two jobs share this port with the same job name, or a rank was "
                           "started twice")
                self._data.setdefault(ERROR_KEY, _error_record("RendezvousError", message))
                self._cond.notify_all()
                send_frame(conn, {"refused": "duplicate", "message": message})
                return None
            self._members[who] = peer
            self._data.pop(GONE_PREFIX + who, None)
        send_frame(conn, {"ok": True, "session": self.session})
        return who

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        with self._cond:
            if op == "set":
                self._data[_key(request)] = _decode_value(request["value"])
                self._cond.notify_all()
                return {"ok": True}
            if op == "get":  # waits up to ``wait_s`` for the key; null when it is still missing
                key = _key(request)
                self._cond.wait_for(lambda: key in self._data or self._closed,
                                    timeout=min(float(request.get("wait_s", 0)), WAIT_SLICE_S))
                value = self._data.get(key)
                return {"value": None if value is None else _encode_value(value)}
            if op == "check":
                keys = request["keys"]
                if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                    raise WireError("check: keys must be strings")
                return {"exists": all(k in self._data for k in keys)}
            if op == "add":
                key, amount = _key(request), request["amount"]
                if type(amount) is not int:
                    raise WireError("add: the amount must be an integer")
                total = int(self._data.get(key, b"0")) + amount
                self._data[key] = str(total).encode()
                self._cond.notify_all()
                return {"value": total}
            if op == "compare_set":
                key = _key(request)
                expected, desired = _decode_value(request["expected"]), _decode_value(request["desired"])
                current = self._data.get(key)
                if (current is None and not expected) or current == expected:
                    self._data[key] = current = desired
                    self._cond.notify_all()
                return {"value": _encode_value(current if current is not None else expected)}
            if op == "delete":
                return {"deleted": self._data.pop(_key(request), None) is not None}
            if op == "num_keys":
                return {"value": len(self._data)}
            if op == "gone":
                return {"ranks": sorted(k[len(GONE_PREFIX):] for k in self._data if k.startswith(GONE_PREFIX))}
        raise WireError(f"unknown store operation {op!r:.40}")


def _key(request: dict[str, Any]) -> str:
    key = request["key"]
    if not isinstance(key, str) or len(key) > 4096:
        raise WireError("a store key must be a string")
    return key


def _error_record(kind: str, message: str) -> bytes:
    from refit_core.net.wire import encode
    return encode({"kind": kind, "message": message})


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


Watch = Callable[[], None]


class _ClosedWithoutAnswer(ConnectionError):
    """The listener closed (or reset) the connection before answering refit's greeting."""


class StoreClient(dist.Store):
    """An authenticated connection to the :class:`StoreServer`, usable wherever torch wants a Store.

    Blocking reads (``get``, ``wait``) return within ``timeout_s`` and call ``watch`` every quarter
    second, which raises when the refit has failed elsewhere: gloo's and NCCL's own rendezvous on this
    store then stop with refit's error instead of their own timeout.
    """

    def __init__(self, endpoint: Endpoint, credentials: JobCredentials, who: str, *, timeout_s: float,
                 handshake_s: float) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.who = who
        self.timeout_s = timeout_s
        self.watch: Watch | None = None
        self._lock = threading.Lock()
        self._sock: socket.socket | None = self._connect(credentials, handshake_s)

    def _connect(self, credentials: JobCredentials, handshake_s: float) -> socket.socket:
        """Connect and authenticate, retrying while nobody listens yet or the host is between setups."""
        deadline = time.monotonic() + self.timeout_s
        last = "nobody listened"
        closing_since: float | None = None  # when a listener first closed on us without answering
        while True:
            try:
                sock = socket.create_connection((self.endpoint.host, self.endpoint.port),
                                                timeout=min(handshake_s, max(0.1, deadline - time.monotonic())))
            except OSError as exc:
                last = f"nobody listened ({exc.strerror or exc})"
            else:
                try:
                    state = self._handshake(sock, credentials, handshake_s)
                except _ClosedWithoutAnswer as exc:
                    # a refit store that is closing (between two setups on one port) does this too: give
                    # its replacement ``handshake_s`` to appear before naming another program
                    closing_since = time.monotonic() if closing_since is None else closing_since
                    if time.monotonic() - closing_since > handshake_s:
                        raise RendezvousError(f"the refit rendezvous at {self.endpoint} does not speak refit's "
                                              f"rendezvous protocol ({exc}, for {handshake_s:.0f} s): another "
                                              "program is listening on that port") from None
                    state = "closing"
                if state is None:
                    return sock
                last = f"the rendezvous was {state} (a previous setup's store had not yet been replaced)"
            if time.monotonic() > deadline:
                raise RendezvousError(f"could not join the refit rendezvous at {self.endpoint} within "
                                      f"{self.timeout_s:.0f} s: {last}; train rank 0 hosts it")
            time.sleep(0.1)

    def _handshake(self, sock: socket.socket, credentials: JobCredentials, handshake_s: float) -> str | None:
        """None when admitted; the host's state when it asks us to come back later; raises otherwise
        (:class:`_ClosedWithoutAnswer` when the listener closed before answering, which :meth:`_connect`
        retries for a while)."""
        where = f"the refit rendezvous at {self.endpoint}"
        sock.settimeout(handshake_s)
        nonce = new_nonce()
        answered = False
        try:
            send_frame(sock, {"protocol": PROTOCOL, "job": credentials.job, "who": self.who, "nonce": nonce})
            reply = recv_frame(sock, HANDSHAKE_BYTES, where)
            answered = True
            if not isinstance(reply, dict):
                raise WireError(f"{where}: unexpected greeting")
            refused = reply.get("refused")
            if refused == "busy":
                _shutdown(sock)
                return str(reply.get("state"))
            if refused == "foreign_job":
                raise AuthenticationError(f"{where} belongs to refit job {reply.get('job')!r:.80}, but this "
                                          f"rank ({self.who}) is of job {credentials.job!r}: two jobs on one port?")
            if refused is not None or reply.get("protocol") != PROTOCOL:
                raise WireError(f"{where}: refused ({refused!r:.40})")
            if not credentials.verify(reply.get("proof"), "host", self.who, nonce, str(reply.get("nonce"))):
                raise AuthenticationError(f"{where} could not prove it knows job {credentials.job!r}'s secret: "
                                          "the ranks were given different secrets (RefitOptions.secret / REFIT_SECRET)")
            send_frame(sock, {"proof": credentials.proof("rank", self.who, nonce, reply["nonce"])})
            verdict = recv_frame(sock, HANDSHAKE_BYTES, where)
        except socket.timeout:
            _shutdown(sock)
            raise RendezvousError(f"{where} accepted the connection but did not answer refit's greeting within "
                                  f"{handshake_s:.0f} s: another program is listening on that port") from None
        except (ConnectionError, OSError, WireError) as exc:
            _shutdown(sock)
            if isinstance(exc, AuthenticationError):
                raise
            if isinstance(exc, ConnectionError) and not answered:
                raise _ClosedWithoutAnswer(str(exc)) from None
            raise RendezvousError(f"{where} does not speak refit's rendezvous protocol ({exc}): "
                                  "another program is listening on that port") from None
        except AuthenticationError:
            _shutdown(sock)
            raise
        if isinstance(verdict, dict) and verdict.get("refused") == "wrong_secret":
            _shutdown(sock)
            raise AuthenticationError(f"{where} refused this rank ({self.who}): wrong secret for job "
                                      f"{credentials.job!r} (RefitOptions.secret / REFIT_SECRET differ)")
        if isinstance(verdict, dict) and verdict.get("refused") == "duplicate":
            _shutdown(sock)
            raise RendezvousError(str(verdict.get("message")))
        if not isinstance(verdict, dict) or verdict.get("ok") is not True:
            _shutdown(sock)
            raise RendezvousError(f"{where}: unexpected answer to this rank's proof")
        sock.settimeout(None)
        return None

    # -- requests -----------------------------------------------------------------------------

    def _request(self, **request: Any) -> dict[str, Any]:
        with self._lock:
            if self._sock is None:
                raise RendezvousError(f"the connection to the refit rendezvous at {self.endpoint} is closed")
            try:
                send_frame(self._sock, request)
                reply = recv_frame(self._sock, MAX_FRAME_BYTES, f"the refit rendezvous at {self.endpoint}")
            except (OSError, ConnectionError) as exc:
                raise RendezvousError(f"lost the refit rendezvous at {self.endpoint} (train rank 0 hosts it "
                                      f"and has probably exited or failed): {exc}") from None
        if not isinstance(reply, dict):
            raise RendezvousError(f"the refit rendezvous at {self.endpoint} sent a malformed reply")
        return reply

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._request(op="set", key=key, value=_encode_value(data))

    def try_get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        """The value of ``key``, waiting at most ``wait_s`` (capped at a quarter second); None if missing."""
        value = self._request(op="get", key=key, wait_s=wait_s)["value"]
        return None if value is None else _decode_value(value)

    def get(self, key: str) -> bytes:
        return self._blocking_get(key, self.timeout_s)

    def _blocking_get(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.try_get(key, wait_s=WAIT_SLICE_S)
            if value is not None:
                return value
            if self.watch is not None:
                self.watch()
            if time.monotonic() > deadline:
                raise RendezvousError(f"timed out after {timeout_s:.0f} s waiting for {key!r} in the refit "
                                      "rendezvous")

    def check(self, keys: list[str]) -> bool:
        return bool(self._request(op="check", keys=list(keys))["exists"])

    def add(self, key: str, amount: int) -> int:
        return int(self._request(op="add", key=key, amount=int(amount))["value"])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        enc = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        return _decode_value(self._request(op="compare_set", key=key, expected=_encode_value(enc[0]),
                                           desired=_encode_value(enc[1]))["value"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self.timeout_s if timeout is None else timeout.total_seconds()
        for key in keys:
            self._blocking_get(key, seconds)

    def delete_key(self, key: str) -> bool:
        return bool(self._request(op="delete", key=key)["deleted"])

    def num_keys(self) -> int:
        return int(self._request(op="num_keys")["value"])

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def gone(self) -> list[str]:
        """Ranks (``"train/1"``) whose connection closed without a goodbye."""
        return list(self._request(op="gone")["ranks"])

    def close(self, goodbye: bool = True) -> None:
        """Leave the store; with ``goodbye`` the host does not record this rank as gone."""
        if goodbye:
            try:
                self._request(op="bye")
            except RendezvousError:
                pass
        with self._lock:
            if self._sock is not None:
                _shutdown(self._sock)
            self._sock = None
