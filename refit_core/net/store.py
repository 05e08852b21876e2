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

This module is the face of three rooms: :mod:`~refit_core.net.store_protocol` (what both ends share),
:mod:`~refit_core.net.store_server` (the host) and :mod:`~refit_core.net.store_client` (a rank's connection).
"""

from refit_core.net.store_client import StoreClient, Watch
from refit_core.net.store_protocol import (
    ANSWER_S,
    CLOSE_S,
    ERROR_KEY,
    FRAME_SLACK_BYTES,
    HANDSHAKE_BYTES,
    MIN_ANSWER_S,
    SEND_S,
    WAIT_SLICE_S,
    Endpoint,
    request_frame_bytes,
)
from refit_core.net.store_server import StoreServer

__all__ = ["ANSWER_S", "CLOSE_S", "ERROR_KEY", "FRAME_SLACK_BYTES", "HANDSHAKE_BYTES", "MIN_ANSWER_S", "SEND_S",
           "WAIT_SLICE_S", "Endpoint", "StoreClient", "StoreServer", "Watch", "request_frame_bytes"]
