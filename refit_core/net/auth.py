"""Who may join a refit: a job identity and a shared secret, proven with HMAC before any read or write.

Every rank of one refit job is given the same ``job`` name and ``secret`` (``RefitOptions.job`` /
``RefitOptions.secret``, or the ``REFIT_JOB`` / ``REFIT_SECRET`` environment overrides, see
:mod:`refit_core.contract.env`). The
rendezvous host and each joining rank prove to each other that they know the secret by an HMAC-SHA256
over both sides' fresh nonces, the job name and the rank's identity; the secret itself never travels.
Without a secret the job name still keeps two jobs apart, but anyone who can reach the port can join:
set a secret whenever the rendezvous address is reachable from other hosts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

DEFAULT_JOB = "refit"
PROTOCOL = "refit-rendezvous/1"


def new_nonce() -> str:
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

    @property
    def authenticated(self) -> bool:
        return bool(self.secret)

    def proof(self, role: str, *parts: str) -> str:
        """HMAC-SHA256 (hex) of the protocol, ``role`` ("host" or "rank"), the job and ``parts``."""
        message = "\x00".join((PROTOCOL, role, self.job, *parts)).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def verify(self, proof: object, role: str, *parts: str) -> bool:
        return isinstance(proof, str) and hmac.compare_digest(proof, self.proof(role, *parts))
