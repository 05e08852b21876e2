"""The store's host on train rank 0: it authenticates ranks, holds them to the limits and answers requests."""

from __future__ import annotations

import errno
import logging
import re
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from refit_core.contract.errors import RendezvousError
from refit_core.contract.options import StoreLimits
from refit_core.contract.side import Side
from refit_core.net.auth import PROTOCOL, JobCredentials, SessionMac, new_nonce
from refit_core.net.keys import GONE_PREFIX, RankRecord, gone_key, rank_key, rank_name, size_key
from refit_core.net.store_protocol import (
    CLOSE_S,
    ERROR_KEY,
    HANDSHAKE_BYTES,
    SEND_S,
    WAIT_SLICE_S,
    Endpoint,
    decode_value,
    encode_value,
    request_frame_bytes,
    shutdown_socket,
    started_note,
    wake_socket,
)
from refit_core.net.wire import WireError, recv_frame, send_frame

log = logging.getLogger("refit")

_IDENTITY = re.compile(r"(train|gen)/(0|[1-9][0-9]{0,9})")
_GUEST = re.compile(r"(replica|observer)/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})/(0|[1-9][0-9]{0,4})")
"""A fleet store's guests (``guests=True``): a replica's rank joining the running job, or ``refit status``."""


class _Refused(Exception):
    """A request over one of the store's limits: answered with this message, the connection stays."""


@dataclass(frozen=True)
class _Member:
    """A connected rank's connection: its peer address, its socket, and its number (each admitted connection
    gets the next one)."""

    peer: str
    conn: socket.socket
    serial: int


class StoreServer:
    """The store's host: one listening socket bound to ``endpoint``'s interface, a thread per client;
    ``limits`` bound what authenticated ranks may store (default :class:`StoreLimits`)."""

    def __init__(self, endpoint: Endpoint, credentials: JobCredentials, *, handshake_s: float,
                 limits: StoreLimits | None = None, guests: bool = False) -> None:
        self.endpoint = endpoint
        self.guests = guests
        """Whether ranks of replicas joining the running job (``replica/NAME/N``) and observers are admitted
        (a fleet's store, :mod:`refit_core.fleet`); they prove the job's secret like any rank."""
        self.credentials = credentials
        self.handshake_s = handshake_s
        self.limits = limits or StoreLimits()
        self.session = new_nonce()
        self.started = time.time()  # told to joiners, so that a rank of another job can say whose store it met
        self._data: dict[str, bytes] = {}
        self._stored = 0  # bytes of keys and values in _data
        self._cond = threading.Condition()
        self._members: dict[str, _Member] = {}  # rank identity -> its connection, while connected
        self._accepted = 0  # connections admitted so far
        self._sealed = False
        self._closed = False
        self._connections: set[socket.socket] = set()
        try:
            infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            self._listener = socket.create_server(sockaddr, family=family, backlog=128)
        except OSError as exc:
            hint = f" (a busy port: {_who_listens(endpoint)})" if exc.errno == errno.EADDRINUSE else ""
            raise RendezvousError(f"could not host the refit rendezvous at {endpoint}: {exc}{hint}") from exc
        self._thread = threading.Thread(target=self._accept_loop, name="refit-store", daemon=True)
        self._thread.start()

    # -- state --------------------------------------------------------------------------------

    def present(self) -> list[str]:
        """The rank identities connected now (what the ``present`` operation answers)."""
        with self._cond:
            return sorted(self._members)

    def connections(self) -> dict[str, int]:
        """Each rank identity connected now, and the number of its connection (every connection admitted gets a
        new one: an identity that left and came back, a restarted process, has another number)."""
        with self._cond:
            return {who: member.serial for who, member in self._members.items()}

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
        wake_socket(self._listener)  # wakes the accept() blocked in the server thread (Linux), which closes it
        for conn in connections:
            wake_socket(conn)  # its own thread closes it
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
                        shutdown_socket(conn)
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
                if who is not None and (held := self._members.get(who)) is not None and held.conn is conn:
                    del self._members[who]
                    if not said_bye and not self._closed:
                        self._put(gone_key(who), b"its connection closed during setup or a step", checked=False)
                        self._cond.notify_all()
            shutdown_socket(conn)

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
            # never the job's name: it is the job's to keep
            send_frame(conn, {"refused": "foreign_job", "started": self.started})
            return None
        with self._cond:  # a failed setup still admits the ranks that have not yet read its error
            busy = ("closed" if self._closed else "sealed" if self._sealed else
                    "failed" if ERROR_KEY in self._data and rank_key(RankRecord.DONE, who) in self._data else None)
        if busy:
            send_frame(conn, {"refused": "busy", "state": busy})
            return None
        mine = new_nonce()
        send_frame(conn, {"protocol": PROTOCOL, "nonce": mine, "started": self.started,
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
            held = self._members.get(who)
            holder = held.peer if held is not None else None
            if held is not None and _GUEST.fullmatch(who) and _closed_by_peer(held.conn):
                # its process died a moment ago (a restart under its name): its thread has yet to see that
                log.debug("refit store: %s from %s replaces its closed connection from %s", who, peer, holder)
                holder = None
            if holder is not None and _GUEST.fullmatch(who):  # a guest's duplicate is its own failure only
                message = (f"{who} is already connected to this refit fleet (from {holder}): a replica identity "
                           "already present is refused; give each replica its own name")
                send_frame(conn, {"refused": "duplicate", "message": message})
                return None
            if holder is not None:
                message = (f"{rank_name(who)} joined the refit rendezvous twice (from {holder} "
                           f"and {peer}): two jobs share this port with the same job name, or a rank was "
                           "started twice")
                if ERROR_KEY not in self._data:
                    self._put(ERROR_KEY, _error_record("RendezvousError", message), checked=False)
                self._cond.notify_all()
                send_frame(conn, {"refused": "duplicate", "message": message})
                return None
            self._accepted += 1
            self._members[who] = _Member(peer, conn, self._accepted)
            self._drop(gone_key(who))
        send_frame(conn, {"ok": True, "session": self.session, "max_frame": request_frame_bytes(self.limits)})
        return who, self.credentials.session("host", who, nonce, mine)

    def _unknown_identity(self, who: str) -> str | None:
        """Why ``who`` is no rank of this job (a side's published world size, else ``max_rank``), or None."""
        if self.guests and _GUEST.fullmatch(who):
            return None
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
                self._put(_key(request), decode_value(request["value"]))
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
                return {"value": None if value is None else encode_value(value)}
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
                expected, desired = decode_value(request["expected"]), decode_value(request["desired"])
                current = self._data.get(key)
                if (current is None and not expected) or current == expected:
                    self._put(key, desired)
                    current = desired
                    self._cond.notify_all()
                return {"value": encode_value(current if current is not None else expected)}
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
            if op == "present":
                return {"ranks": self.present()}
            if op == "gone":
                return {"ranks": sorted(k[len(GONE_PREFIX):] for k in self._data if k.startswith(GONE_PREFIX))}
        raise WireError(f"unknown store operation {op!r:.40}")


def _who_listens(endpoint: Endpoint, timeout_s: float = 1.0) -> str:
    """Who holds ``endpoint``, as its greeting of a stranger says: never joined, whatever answers."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s) as probe:
            probe.settimeout(timeout_s)
            send_frame(probe, {"protocol": PROTOCOL, "job": f"refit-probe/{new_nonce()}", "who": "train/0",
                               "nonce": new_nonce()})
            reply = recv_frame(probe, HANDSHAKE_BYTES, f"the listener at {endpoint}")
    except socket.timeout:  # accepted, then silent: the kernel accepts for a stopped process too
        return (f"the process listening there accepted but did not answer within {timeout_s:.0f} s: it is stopped "
                "or hung (a refit store host, train rank 0, stopped with SIGSTOP? end it, or use another port), "
                "or another program")
    except (OSError, ConnectionError, WireError):
        reply = None
    if isinstance(reply, dict) and (reply.get("refused") == "foreign_job" or reply.get("protocol") == PROTOCOL):
        return (f"it holds another refit rendezvous ({started_note(reply)}): another refit job's, or an earlier "
                "setup of this job not yet closed; give each job its own port")
    return "another program, not a refit rendezvous, listens there"


def _key(request: dict[str, Any]) -> str:
    key = request["key"]
    if not isinstance(key, str) or len(key) > 4096:
        raise WireError("a store key must be a string")
    return key


def _error_record(kind: str, message: str) -> bytes:
    from refit_core.net.wire import encode
    return encode({"kind": kind, "message": message})


def _closed_by_peer(conn: socket.socket) -> bool:
    """Whether the other end of ``conn`` closed it (its process exited or was killed), without reading a byte or
    waiting."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False  # open, nothing to read
    except (OSError, ValueError):
        return True  # reset, or closed here
