"""refit's own key-value store: an authenticated TCP server on train rank 0 and a client on every rank.

Why not torch's ``TCPStore``: it listens on every interface whatever address it is given, lets any
client read and write without credentials, and refit used to pickle into it. This store

- binds only to the interface of the address it is given;
- speaks length-prefixed JSON (:mod:`refit_core.net.wire`, nesting depth limited); values are opaque
  bytes, never unpickled;
- runs a mutual HMAC handshake (:mod:`refit_core.net.auth`) before a client may read or write a key:
  a rank of another job (told so without learning the job's name), a wrong secret, a program that is
  not refit, or a listener that never answers get a named
  :class:`~refit_core.contract.errors.RendezvousError` within ``handshake_s`` (twice that for a
  listener that closes connections without a word, which a refit store closing between two setups on
  one port also does: its replacement gets ``handshake_s`` to appear);
- tags every later frame with a per-connection session key and a sequence number
  (:class:`~refit_core.net.auth.SessionMac`): a relay on the path cannot inject, alter or replay a
  request or an answer (without a secret the key is public: see :mod:`refit_core.net.auth`);
- admits only identities ``train/N`` / ``gen/N`` with N below the side's published world size, and
  holds every authenticated rank to :class:`~refit_core.contract.options.StoreLimits` (value size, bytes
  and keys held, request frame size): a request over a limit is refused with a named error and the
  store keeps serving the job;
- bounds every wait: a client gives the host ``min(timeout_s, ANSWER_S)`` to answer a request (plus
  the time the request holds a read open; within a wait, no longer than what is left of its deadline)
  and :data:`CLOSE_S` to answer the goodbye, then names it stopped, hung or overloaded; the host gives
  a reply :data:`SEND_S` to leave, so a stopped client never blocks it, and ``close()`` is bounded;
- knows which rank each connection belongs to: a rank that joins twice is refused (two jobs on one
  port), and a rank whose connection closes without saying goodbye is recorded as *gone*, so the
  others stop waiting for it at once instead of at their deadline;
- stops admitting ranks once sealed (setup finished) or failed: a rank starting a new setup waits
  until the host starts a fresh store on the same port instead of joining a finished one.

Why this store and not a maintained secure channel: Python's ``ssl`` can run TLS on a pre-shared key
only from Python 3.13 (``SSLContext.set_psk_*_callback``; refit supports 3.11), and TLS with
certificates would need a PKI every launcher distributes. pyzmq's CURVE (installed here, 27.3) is
public-key, so a shared secret would have to be turned into key pairs plus a ZAP handler, it adds a core
dependency, and its sockets hide connection lifetime, which the store needs to name a rank that died
within seconds. The channel refit needs is authentication and integrity, not secrecy (setup data is
shapes and plans; NCCL's unique ids travel here too, but NCCL's own sockets authenticate nobody
either): HMAC-SHA256 from the standard library gives that in a few lines.

:class:`StoreClient` is a ``torch.distributed.Store``, so gloo and NCCL build their communicators on it.
"""

from __future__ import annotations

import base64
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from refit_core.contract.errors import AuthenticationError, RendezvousError
from refit_core.contract.options import StoreLimits
from refit_core.contract.side import Side
from refit_core.net.auth import PROTOCOL, JobCredentials, SessionMac, new_nonce
from refit_core.net.keys import GONE_PREFIX, RankRecord, gone_key, rank_key, rank_name, size_key
from refit_core.net.wire import WireError, recv_frame, send_frame

log = logging.getLogger("refit")

HANDSHAKE_BYTES = 2048  # before a peer is authenticated it may not make us allocate more
FRAME_SLACK_BYTES = 64 << 10  # a request's key and JSON around its value
WAIT_SLICE_S = 0.25  # a blocking read returns this often so the client can check for failures
ANSWER_S = 30.0
"""The longest a client waits for the host's answer to one request (capped at its ``timeout_s``), on
top of the time the request holds a read open."""
MIN_ANSWER_S = 1.0  # a wait's last request still gets this long, however little of its deadline is left
CLOSE_S = 2.0
"""The longest a client waits for the answer to its goodbye."""
SEND_S = 30.0
"""The longest the host waits for a reply to leave (a stopped client stops reading)."""
ERROR_KEY = "error"
_IDENTITY = re.compile(r"(train|gen)/(0|[1-9][0-9]{0,9})")


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


def request_frame_bytes(limits: StoreLimits) -> int:
    """The largest frame a request may be: one value of ``limits.max_value_bytes`` in base64, and its key."""
    return 4 * -(-limits.max_value_bytes // 3) + FRAME_SLACK_BYTES


def _encode_value(value: bytes) -> str:
    return base64.b64encode(value).decode()


def _decode_value(value: Any) -> bytes:
    if not isinstance(value, str):
        raise WireError("a store value is not a string")
    return base64.b64decode(value, validate=True)


class _Refused(Exception):
    """A request over one of the store's limits: answered with this message, the connection stays."""


class StoreServer:
    """The store's host: one listening socket bound to ``endpoint``'s interface, a thread per client;
    ``limits`` bound what authenticated ranks may store (default :class:`StoreLimits`)."""

    def __init__(self, endpoint: Endpoint, credentials: JobCredentials, *, handshake_s: float,
                 limits: StoreLimits | None = None) -> None:
        self.endpoint = endpoint
        self.credentials = credentials
        self.handshake_s = handshake_s
        self.limits = limits or StoreLimits()
        self.session = new_nonce()
        self._data: dict[str, bytes] = {}
        self._stored = 0  # bytes of keys and values in _data
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
        """Stop serving: bounded whatever the clients do (a stopped client's thread is woken by the shutdown)."""
        with self._cond:
            self._closed = True
            connections = list(self._connections)
            self._cond.notify_all()
        _wake(self._listener)  # wakes the accept() blocked in the server thread (Linux), which closes it
        for conn in connections:
            _wake(conn)  # its own thread closes it
        self._thread.join(timeout=CLOSE_S)

    # -- connections --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        try:
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
        finally:
            self._listener.close()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        who = None
        said_bye = False
        try:
            admitted = self._handshake(conn, peer)
            if admitted is None:
                return
            who, mac = admitted
            request_bytes = request_frame_bytes(self.limits)
            while True:
                conn.settimeout(None)  # a rank may stay quiet for a whole training run between requests
                request = recv_frame(conn, request_bytes, f"a request from {who}", seal=mac)
                if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                    raise WireError(f"malformed request from {who}")
                conn.settimeout(SEND_S)
                if request["op"] == "bye":
                    said_bye = True
                    send_frame(conn, {"ok": True}, mac)
                    return
                try:
                    reply = self._handle(request)
                except _Refused as exc:
                    reply = {"refused": "limit", "message": str(exc)}
                send_frame(conn, reply, mac)
        except WireError as exc:
            (log.warning if who is not None else log.debug)(
                "refit store: dropped the connection from %s (%s): %s", peer, who or "not admitted", exc)
        except (OSError, ConnectionError, ValueError, TypeError, KeyError) as exc:
            log.debug("refit store: connection from %s (%s) ended: %s", peer, who, exc)
        finally:
            with self._cond:
                self._connections.discard(conn)
                if who is not None and self._members.get(who) == peer:
                    del self._members[who]
                    if not said_bye and not self._closed:
                        self._put(gone_key(who), b"its connection closed during setup or a step", checked=False)
                        self._cond.notify_all()
            _shutdown(conn)

    def _handshake(self, conn: socket.socket, peer: str) -> tuple[str, SessionMac] | None:
        """Authenticate a joining rank; its identity and the connection's frame tags, or None after
        refusing it (with a reason)."""
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
            send_frame(conn, {"refused": "foreign_job"})  # never the job's name: it is the job's to keep
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
            unknown = self._unknown_identity(who)
            if unknown is not None:
                send_frame(conn, {"refused": "identity", "message": unknown})
                log.warning("refit store: refused %s: %s", peer, unknown)
                return None
            holder = self._members.get(who)
            if holder is not None:
                message = (f"{rank_name(who)} joined the refit rendezvous twice (from {holder} "
                           f"and {peer}): two jobs share this port with the same job name, or a rank was "
                           "started twice")
                if ERROR_KEY not in self._data:
                    self._put(ERROR_KEY, _error_record("RendezvousError", message), checked=False)
                self._cond.notify_all()
                send_frame(conn, {"refused": "duplicate", "message": message})
                return None
            self._members[who] = peer
            self._drop(gone_key(who))
        send_frame(conn, {"ok": True, "session": self.session, "max_frame": request_frame_bytes(self.limits)})
        return who, self.credentials.session("host", who, nonce, mine)

    def _unknown_identity(self, who: str) -> str | None:
        """Why ``who`` is no rank of this job (a side's published world size, else ``max_rank``), or None."""
        match = _IDENTITY.fullmatch(who)
        if match is None:
            return f"{who!r:.80} is not a refit rank's identity (train/N or gen/N)"
        side, rank = Side(match[1]), int(match[2])
        raw = self._data.get(size_key(side))
        size = int(raw) if raw is not None and raw.isdigit() else None
        bound, what = ((size, f"the {side.value} side has {size} ranks") if size is not None else
                       (self.limits.max_rank, f"above StoreLimits.max_rank={self.limits.max_rank}"))
        return None if rank < bound else f"{rank_name(who)} is not a rank of this refit job: {what}"

    # -- data ---------------------------------------------------------------------------------

    def _put(self, key: str, value: bytes, *, checked: bool = True) -> None:
        """Store ``value`` under ``key``; with ``checked``, :class:`_Refused` where a limit would be passed."""
        old = self._data.get(key)
        grow = len(value) - len(old) if old is not None else len(key) + len(value)
        if checked:
            limits = self.limits
            if len(value) > limits.max_value_bytes:
                raise _Refused(f"the refit store refused a value of {len(value)} bytes under {key!r:.80}: the "
                               f"limit is {limits.max_value_bytes} (StoreLimits.max_value_bytes on train rank 0)")
            if old is None and len(self._data) >= limits.max_keys:
                raise _Refused(f"the refit store refused key {key!r:.80}: it holds {len(self._data)} keys, the "
                               f"limit (StoreLimits.max_keys on train rank 0)")
            if self._stored + grow > limits.max_stored_bytes:
                raise _Refused(f"the refit store refused {len(value)} bytes under {key!r:.80}: it holds "
                               f"{self._stored} bytes and the limit is {limits.max_stored_bytes} "
                               "(StoreLimits.max_stored_bytes on train rank 0)")
        self._data[key] = value
        self._stored += grow

    def _drop(self, key: str) -> bool:
        value = self._data.pop(key, None)
        if value is None:
            return False
        self._stored -= len(key) + len(value)
        return True

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        with self._cond:
            if op == "set":
                self._put(_key(request), _decode_value(request["value"]))
                self._cond.notify_all()
                return {"ok": True}
            if op == "get":  # waits up to ``wait_s`` for the key; null when it is still missing
                key = _key(request)
                wait_s = request.get("wait_s", 0)
                if type(wait_s) not in (int, float):
                    raise WireError("get: wait_s must be a number")
                self._cond.wait_for(lambda: key in self._data or self._closed,
                                    timeout=min(max(float(wait_s), 0.0), WAIT_SLICE_S))
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
                try:
                    total = int(self._data.get(key, b"0")) + amount
                except ValueError:
                    raise _Refused(f"the refit store cannot add to {key!r:.80}: it does not hold an integer") from None
                self._put(key, str(total).encode())
                self._cond.notify_all()
                return {"value": total}
            if op == "compare_set":
                key = _key(request)
                expected, desired = _decode_value(request["expected"]), _decode_value(request["desired"])
                current = self._data.get(key)
                if (current is None and not expected) or current == expected:
                    self._put(key, desired)
                    current = desired
                    self._cond.notify_all()
                return {"value": _encode_value(current if current is not None else expected)}
            if op == "delete":
                return {"deleted": self._drop(_key(request))}
            if op == "delete_prefixed":
                prefixes = request["prefixes"]
                if (not isinstance(prefixes, list) or not 0 < len(prefixes) <= 64
                        or not all(isinstance(p, str) and 0 < len(p) <= 4096 for p in prefixes)):
                    raise WireError("delete_prefixed: prefixes must be 1 to 64 non-empty strings")
                doomed = [k for k in self._data if k.startswith(tuple(prefixes))]
                for k in doomed:
                    self._drop(k)
                return {"deleted": len(doomed)}
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


def _wake(conn: socket.socket) -> None:
    """Make every read and write of ``conn`` end at once, in whichever thread; its owner closes it (closing
    it here could let the descriptor be reused under a thread still using it)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _shutdown(conn: socket.socket) -> None:
    """End and close ``conn``; only the thread that uses it may."""
    _wake(conn)
    conn.close()


Watch = Callable[[], None]


class _ClosedWithoutAnswer(ConnectionError):
    """The listener closed (or reset) the connection before answering refit's greeting."""


class StoreClient(dist.Store):
    """An authenticated connection to the :class:`StoreServer`, usable wherever torch wants a Store.

    Blocking reads (``get``, ``wait``) return within ``timeout_s`` and call ``watch`` every quarter
    second, which raises when the refit has failed elsewhere: gloo's and NCCL's own rendezvous on this
    store then stop with refit's error instead of their own timeout. Every request is bounded
    (``answer_s``, see the module doc); a host that does not answer in time is a
    :class:`~refit_core.contract.errors.RendezvousError` and the connection is dropped (every later
    request raises the same error at once).
    """

    def __init__(self, endpoint: Endpoint, credentials: JobCredentials, who: str, *, timeout_s: float,
                 handshake_s: float) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.who = who
        self.timeout_s = timeout_s
        self.answer_s = min(timeout_s, ANSWER_S)
        """How long the host may take to answer one request (beyond the read it holds open)."""
        self.watch: Watch | None = None
        self._lock = threading.Lock()
        self._mac: SessionMac | None = None
        self._reply_bytes = HANDSHAKE_BYTES  # the host says how large its frames may be when it admits us
        self._broken: str | None = None  # why the connection was dropped
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
                raise AuthenticationError(f"{where} belongs to a different refit job (job names differ): this rank "
                                          f"({self.who}) is of job {credentials.job!r}: two jobs on one port?")
            if refused is not None or reply.get("protocol") != PROTOCOL:
                raise WireError(f"{where}: refused ({refused!r:.40})")
            host_nonce = str(reply.get("nonce"))
            if not credentials.verify(reply.get("proof"), "host", self.who, nonce, host_nonce):
                raise AuthenticationError(f"{where} could not prove it knows job {credentials.job!r}'s secret: "
                                          "the ranks were given different secrets (RefitOptions.secret / REFIT_SECRET)")
            send_frame(sock, {"proof": credentials.proof("rank", self.who, nonce, host_nonce)})
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
        refused = verdict.get("refused") if isinstance(verdict, dict) else None
        if refused is not None or not isinstance(verdict, dict) or verdict.get("ok") is not True:
            _shutdown(sock)
            if refused == "wrong_secret":
                raise AuthenticationError(f"{where} refused this rank ({self.who}): wrong secret for job "
                                          f"{credentials.job!r} (RefitOptions.secret / REFIT_SECRET differ)")
            if refused in ("duplicate", "identity"):
                raise RendezvousError(str(verdict.get("message"))[:1000])
            raise RendezvousError(f"{where}: unexpected answer to this rank's proof")
        max_frame = verdict.get("max_frame")
        self._reply_bytes = max_frame if type(max_frame) is int and max_frame > 0 else HANDSHAKE_BYTES
        self._mac = credentials.session("rank", self.who, nonce, host_nonce)
        return None

    # -- requests -----------------------------------------------------------------------------

    def _request(self, request: dict[str, Any], *, holds_s: float = 0.0, within: float | None = None,
                 answer_s: float | None = None) -> dict[str, Any]:
        """Send ``request`` and return the host's answer, which must come within ``answer_s`` (default
        :attr:`answer_s`, no longer than ``within`` when given, at least :data:`MIN_ANSWER_S`) plus
        ``holds_s``, the time the host may hold it open."""
        if answer_s is None:
            answer_s = self.answer_s if within is None else min(self.answer_s, max(within, MIN_ANSWER_S))
        budget = answer_s + holds_s
        where = f"the refit rendezvous at {self.endpoint}"
        if not self._lock.acquire(timeout=budget):
            raise RendezvousError(f"{where}: another request of this rank did not finish within {budget:.1f} s")
        try:
            sock = self._sock
            if sock is None:
                raise RendezvousError(self._broken or f"the connection to {where} is closed")
            try:
                sock.settimeout(budget)
                send_frame(sock, request, self._mac)
                reply = recv_frame(sock, self._reply_bytes, where, seal=self._mac,
                                   deadline=time.monotonic() + budget)
            except socket.timeout:
                raise self._drop(f"{where} (train rank 0 hosts it) did not answer within {budget:.1f} s: it is "
                                 "stopped, hung or overloaded") from None
            except (OSError, ConnectionError) as exc:
                raise self._drop(f"lost {where} (train rank 0 hosts it and has probably exited or failed): "
                                 f"{exc}") from None
            except WireError as exc:
                raise self._drop(f"{where} sent a bad answer: {exc}") from None
        finally:
            self._lock.release()
        if not isinstance(reply, dict):
            raise RendezvousError(f"{where} sent a malformed reply")
        if reply.get("refused") == "limit":
            raise RendezvousError(str(reply.get("message"))[:1000])
        return reply

    def _drop(self, why: str) -> RendezvousError:
        """Drop the connection (its frames are out of step now) and remember why; the error to raise."""
        self._broken = why
        if self._sock is not None:
            _shutdown(self._sock)
            self._sock = None
        return RendezvousError(why)

    def _answer(self, reply: dict[str, Any], name: str) -> Any:
        if name not in reply:
            raise RendezvousError(f"the refit rendezvous at {self.endpoint} answered without {name!r}")
        return reply[name]

    def set(self, key: str, value: bytes | str, within: float | None = None) -> None:
        """Store ``value`` under ``key``; ``within``: what is left of the caller's deadline (None: a
        plain request's :attr:`answer_s`)."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._request({"op": "set", "key": key, "value": _encode_value(data)}, within=within)

    def try_get(self, key: str, wait_s: float = 0.0, within: float | None = None) -> bytes | None:
        """The value of ``key``, waiting at most ``wait_s`` (capped at a quarter second); None if missing.
        ``within``: what is left of the caller's deadline (the host's answer is not awaited much longer)."""
        wait_s = min(wait_s, WAIT_SLICE_S)
        value = self._answer(self._request({"op": "get", "key": key, "wait_s": wait_s}, holds_s=wait_s,
                                           within=within), "value")
        try:
            return None if value is None else _decode_value(value)
        except (WireError, ValueError):
            raise RendezvousError(f"the refit rendezvous at {self.endpoint} sent a malformed value") from None

    def get(self, key: str) -> bytes:
        return self._blocking_get(key, self.timeout_s)

    def _blocking_get(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.try_get(key, wait_s=WAIT_SLICE_S, within=deadline - time.monotonic())
            if value is not None:
                return value
            if self.watch is not None:
                self.watch()
            if time.monotonic() > deadline:
                raise RendezvousError(f"timed out after {timeout_s:.0f} s waiting for {key!r} in the refit "
                                      "rendezvous")

    def check(self, keys: list[str]) -> bool:
        return bool(self._answer(self._request({"op": "check", "keys": list(keys)}), "exists"))

    def add(self, key: str, amount: int) -> int:
        return int(self._answer(self._request({"op": "add", "key": key, "amount": int(amount)}), "value"))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        enc = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        reply = self._request({"op": "compare_set", "key": key, "expected": _encode_value(enc[0]),
                               "desired": _encode_value(enc[1])})
        try:
            return _decode_value(self._answer(reply, "value"))
        except (WireError, ValueError):
            raise RendezvousError(f"the refit rendezvous at {self.endpoint} sent a malformed value") from None

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self.timeout_s if timeout is None else timeout.total_seconds()
        for key in keys:
            self._blocking_get(key, seconds)

    def delete_key(self, key: str) -> bool:
        return bool(self._answer(self._request({"op": "delete", "key": key}), "deleted"))

    def delete_prefixed(self, prefixes: list[str], within: float | None = None) -> int:
        """Delete every key that starts with one of ``prefixes``; how many there were."""
        return int(self._answer(self._request({"op": "delete_prefixed", "prefixes": list(prefixes)}, within=within),
                                "deleted"))

    def num_keys(self) -> int:
        return int(self._answer(self._request({"op": "num_keys"}), "value"))

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def gone(self, within: float | None = None) -> list[str]:
        """Ranks (``"train/1"``) whose connection closed without a goodbye."""
        return [str(r) for r in self._answer(self._request({"op": "gone"}, within=within), "ranks")]

    def close(self, goodbye: bool = True) -> None:
        """Leave the store; with ``goodbye`` the host does not record this rank as gone. Returns within
        about :data:`CLOSE_S` whatever the host does."""
        if goodbye and self._sock is not None:
            try:
                self._request({"op": "bye"}, answer_s=CLOSE_S)
            except RendezvousError:
                pass
        locked = self._lock.acquire(timeout=CLOSE_S)
        try:
            sock, self._sock = self._sock, None
            if sock is not None:
                if locked:
                    _shutdown(sock)
                else:  # another thread's request still uses it: wake it; the socket closes when it lets go
                    _wake(sock)
        finally:
            if locked:
                self._lock.release()
