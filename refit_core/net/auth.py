"""Who may join a refit: a job identity and a shared secret, proven with HMAC before any read or write.

Every rank of one refit job is given the same ``job`` name and ``secret`` (``RefitOptions.job`` /
``RefitOptions.secret``, or the ``REFIT_JOB`` / ``REFIT_SECRET`` environment overrides, see
:mod:`refit_core.contract.env`). The
rendezvous host and each joining rank prove to each other that they know the secret by an HMAC-SHA256
over both sides' fresh nonces, the job name and the rank's identity; the secret itself never travels.
Every later frame of the connection carries an HMAC-SHA256 tag under a key of its own (derived from the
secret, both nonces and the direction) over a sequence number and the frame (:class:`SessionMac`), so a
relay on the path can neither inject, alter, reorder nor replay a request or an answer.

A secret is required: setup refuses to start without one (:data:`NO_SECRET` says what to set) unless the
rank opts out by name (``RefitOptions(insecure=True)`` / ``REFIT_INSECURE=1``). Each job's launcher gives
its ranks their own (``refit demo``, ``RayRefit``, ``refit_core.apps.spawn``, the vLLM drop-in's trainer,
torchrun's random run id), so two jobs that meet on one port are two secrets: a rank of one cannot join the
other's store (it is refused, by name, before it reads or writes anything), and no byte of one job's weights
can reach the other's ranks. Opted out, the job name alone keeps jobs apart: any process that can reach the
port, every process of the same host included, can join the job, read its metadata and write into it, and
two jobs with one name on one port can mix; the frame tags are then keyed with public values only and catch
corruption, not forgery. A rendezvous without a secret logs a warning once per process
(:func:`warn_without_secret`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from dataclasses import dataclass, field

from refit_core.contract.errors import AuthenticationError, WireError
from refit_core.contract.options import RefitOptions

DEFAULT_JOB = "refit"
PROTOCOL = "refit-rendezvous/2"
log = logging.getLogger("refit")
SET_A_SECRET = ("give every rank of both sides the same random secret: REFIT_SECRET=$(refit secret) in each "
                "program's environment, or RefitOptions(secret=...)")
NO_SECRET = (f"refit refuses to set up without a secret: anyone who can reach the rendezvous could join the job "
             f"and two jobs on one port could exchange weights. No launcher gave this rank one (refit demo, "
             f"RayRefit, refit_core.apps.spawn, torchrun --standalone and the vLLM drop-in's single-rank trainer "
             f"do); {SET_A_SECRET}; or opt out by name with RefitOptions(insecure=True) / REFIT_INSECURE=1")


def new_nonce() -> str:
    return secrets.token_hex(16)


def new_secret() -> str:
    """A fresh random secret (128 bits, hex) for launchers that start every rank of a job themselves."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class JobCredentials:
    """A job's name and shared secret (empty: no authentication, the job name only)."""

    job: str = DEFAULT_JOB
    secret: bytes = field(default=b"", repr=False)

    @classmethod
    def of(cls, job: str | None, secret: str | bytes | None) -> JobCredentials:
        """From :class:`~refit_core.contract.options.RefitOptions` ``job`` / ``secret`` (None: the defaults)."""
        secret = secret or b""
        return cls(job or DEFAULT_JOB, secret.encode() if isinstance(secret, str) else bytes(secret))

    @classmethod
    def required(cls, options: RefitOptions, who: str) -> JobCredentials:
        """``options``' credentials; raises :class:`AuthenticationError` (:data:`NO_SECRET`, naming ``who``)
        where they carry no secret and ``options.insecure`` does not opt out."""
        if not options.secret and not options.insecure:
            raise AuthenticationError(f"{who}: {NO_SECRET}")
        return cls.of(options.job, options.secret)

    @property
    def authenticated(self) -> bool:
        """True when a secret is set (an empty secret authenticates nobody)."""
        return bool(self.secret)

    def proof(self, role: str, *parts: str) -> str:
        """HMAC-SHA256 (hex) of the protocol, ``role`` ("host" or "rank"), the job and ``parts``."""
        message = "\x00".join((PROTOCOL, role, self.job, *parts)).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def verify(self, proof: object, role: str, *parts: str) -> bool:
        return isinstance(proof, str) and hmac.compare_digest(proof, self.proof(role, *parts))

    def session(self, role: str, who: str, rank_nonce: str, host_nonce: str) -> SessionMac:
        """The frame tags of one authenticated connection, seen from ``role`` ("host" or "rank")."""
        keys = {sender: bytes.fromhex(self.proof(f"session:{sender}", who, rank_nonce, host_nonce))
                for sender in ("host", "rank")}
        other = "rank" if role == "host" else "host"
        return SessionMac(keys[role], keys[other])


class SessionMac:
    """HMAC-SHA256 tags over ``sequence number || frame``, one key and one counter per direction: a
    frame from the other side is accepted only once, in order, unaltered (a
    :class:`~refit_core.net.wire.FrameSeal`). Not thread-safe: one connection, one reader, one writer."""

    tag_bytes = hashlib.sha256().digest_size

    def __init__(self, send_key: bytes, receive_key: bytes) -> None:
        self._send_key, self._receive_key = send_key, receive_key
        self._sent = self._received = 0

    def seal(self, body: bytes) -> bytes:
        tag = hmac.new(self._send_key, self._sent.to_bytes(8, "big") + body, hashlib.sha256).digest()
        self._sent += 1
        return tag

    def check(self, body: bytes, tag: bytes, what: str) -> None:
        expected = hmac.new(self._receive_key, self._received.to_bytes(8, "big") + body, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, tag):
            raise WireError(f"{what}: a frame failed its authentication (HMAC): altered, injected or replayed "
                            "on the way (a relay on the path?), or sent by a program that is not this job's")
        self._received += 1


_warned = threading.Event()


def warn_without_secret(credentials: JobCredentials, where: str) -> None:
    """Log a warning (once per process) when ``credentials`` carry no secret: anyone who can reach
    the rendezvous at ``where`` can join the job, local processes included."""
    if credentials.authenticated or _warned.is_set():
        return
    _warned.set()
    log.warning("refit: job %r runs without a secret (insecure=True): any process that can reach the rendezvous "
                "at %s, every local process of this host included, can join the job, read its setup data and "
                "break its setup, and another job of the same name on that port can exchange weights with it. "
                "To be safe, %s; RayRefit, `refit demo` and refit_core.apps.spawn make one themselves.",
                credentials.job, where, SET_A_SECRET)
