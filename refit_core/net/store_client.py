"""A rank's authenticated connection to the store, usable wherever torch wants a ``Store``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from refit_core.contract.errors import AuthenticationError, RendezvousError
from refit_core.net.auth import PROTOCOL, SET_A_SECRET, JobCredentials, SessionMac, new_nonce
from refit_core.net.store_protocol import (
    ANSWER_S,
    CLOSE_S,
    HANDSHAKE_BYTES,
    MIN_ANSWER_S,
    WAIT_SLICE_S,
    Endpoint,
    decode_value,
    encode_value,
    shutdown_socket,
    started_note,
    wake_socket,
)
from refit_core.net.wire import WireError, recv_frame, send_frame

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
                 handshake_s: float, host: str = "train rank 0") -> None:
        super().__init__()
        self.endpoint = endpoint
        self.who = who
        self.host = host
        """Who hosts the store, as errors name it."""
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
                                      f"{self.timeout_s:.0f} s: {last}; {self.host} hosts it")
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
                shutdown_socket(sock)
                return str(reply.get("state"))
            if refused == "foreign_job":
                raise AuthenticationError(f"{where} is another refit job's ({started_note(reply)}; job names "
                                          f"differ): this rank ({self.who}) is of job {credentials.job!r}: two jobs "
                                          "on one port? Give each job its own port")
            if refused is not None or reply.get("protocol") != PROTOCOL:
                raise WireError(f"{where}: refused ({refused!r:.40})")
            host_nonce = str(reply.get("nonce"))
            if not credentials.verify(reply.get("proof"), "host", self.who, nonce, host_nonce):
                raise AuthenticationError(f"{where} is another refit job's ({started_note(reply)}; it could not "
                                          f"prove it knows job {credentials.job!r}'s secret): two jobs on one port, "
                                          "or the ranks of this job were given different secrets. "
                                          f"{SET_A_SECRET.capitalize()}; give each job its own port")
            send_frame(sock, {"proof": credentials.proof("rank", self.who, nonce, host_nonce)})
            verdict = recv_frame(sock, HANDSHAKE_BYTES, where)
        except socket.timeout:
            shutdown_socket(sock)
            raise RendezvousError(f"{where} accepted the connection but did not answer refit's greeting within "
                                  f"{handshake_s:.0f} s: the process listening on that port is stopped or hung (a "
                                  "previous store host, train rank 0, stopped with SIGSTOP? end it, or set up on "
                                  "another port), or another program listens there") from None
        except (ConnectionError, OSError, WireError) as exc:
            shutdown_socket(sock)
            if isinstance(exc, AuthenticationError):
                raise
            if isinstance(exc, ConnectionError) and not answered:
                raise _ClosedWithoutAnswer(str(exc)) from None
            raise RendezvousError(f"{where} does not speak refit's rendezvous protocol ({exc}): "
                                  "another program is listening on that port") from None
        except AuthenticationError:
            shutdown_socket(sock)
            raise
        refused = verdict.get("refused") if isinstance(verdict, dict) else None
        if refused is not None or not isinstance(verdict, dict) or verdict.get("ok") is not True:
            shutdown_socket(sock)
            if refused == "wrong_secret":
                raise AuthenticationError(f"{where} refused this rank ({self.who}): wrong secret for job "
                                          f"{credentials.job!r}: it is another refit job's, or the ranks were given "
                                          f"different secrets. {SET_A_SECRET.capitalize()}")
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
                raise self._drop(f"{where} ({self.host} hosts it) did not answer within {budget:.1f} s: it is "
                                 "stopped, hung or overloaded") from None
            except (OSError, ConnectionError) as exc:
                raise self._drop(f"lost {where} ({self.host} hosts it and has probably exited or failed): "
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
            shutdown_socket(self._sock)
            self._sock = None
        return RendezvousError(why)

    def _answer(self, reply: dict[str, Any], name: str) -> Any:
        if name not in reply:
            raise RendezvousError(f"the refit rendezvous at {self.endpoint} answered without {name!r}")
        return reply[name]

    @property
    def local_host(self) -> str:
        """The address of this rank's interface that reaches the store's host (where this rank can serve others
        on that network)."""
        sock = self._sock
        if sock is None:
            raise RendezvousError(f"the connection to the refit rendezvous at {self.endpoint} is closed")
        return str(sock.getsockname()[0])

    def set(self, key: str, value: bytes | str, within: float | None = None) -> None:
        """Store ``value`` under ``key``; ``within``: what is left of the caller's deadline (None: a
        plain request's :attr:`answer_s`)."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._request({"op": "set", "key": key, "value": encode_value(data)}, within=within)

    def try_get(self, key: str, wait_s: float = 0.0, within: float | None = None) -> bytes | None:
        """The value of ``key``, waiting at most ``wait_s`` (capped at a quarter second); None if missing.
        ``within``: what is left of the caller's deadline (the host's answer is not awaited much longer)."""
        wait_s = min(wait_s, WAIT_SLICE_S)
        value = self._answer(self._request({"op": "get", "key": key, "wait_s": wait_s}, holds_s=wait_s,
                                           within=within), "value")
        try:
            return None if value is None else decode_value(value)
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
        reply = self._request({"op": "compare_set", "key": key, "expected": encode_value(enc[0]),
                               "desired": encode_value(enc[1])})
        try:
            return decode_value(self._answer(reply, "value"))
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

    def present(self, within: float | None = None) -> list[str]:
        """The store identities connected now (``"gen/0"``, a fleet's ``"replica/r1/0"``)."""
        return [str(r) for r in self._answer(self._request({"op": "present"}, within=within), "ranks")]

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
                    shutdown_socket(sock)
                else:  # another thread's request still uses it: wake it; the socket closes when it lets go
                    wake_socket(sock)
        finally:
            if locked:
                self._lock.release()
