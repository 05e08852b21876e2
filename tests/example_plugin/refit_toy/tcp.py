"""An example third-party transport, ``toy-tcp``: plain TCP sockets between every pair of ranks (CPU tensors).

The transport docs/writing-a-transport.md walks through. It imports only refit's public surface
(``refit_core`` and ``refit_core.transports``) and registers under the entry-point group
``refit.transports`` (this distribution's ``pyproject.toml``), like any third-party transport.

- Opening: every rank listens on the interface that reaches the rendezvous, publishes its address in the
  refit's store, connects to every lower rank and accepts every higher one: one socket per pair.
- Exchanging: each pair's socket has a sending and a receiving thread, each working its queue of messages in
  the order they were posted; both ends of a pair post the same messages in the same order (refit's
  executors do), so every message is a length header and its bytes, read straight into the receiving tensor.
  ``after`` fences are waited for on the host before anything is posted.
- Failing: a peer that closed its socket (it aborted, closed or died) fails every wait on it at once; a wait
  that takes long asks the refit's :class:`~refit_core.transports.PeerWatch` whether a peer is gone or gave up.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from refit_core import OptionError, TransferError
from refit_core.transports import (
    DoneFence,
    Fence,
    PeerWatch,
    Transport,
    TransportContext,
    TransportOptions,
    TransportType,
    check_contiguous,
)

NAME = "toy-tcp"
_LENGTH = struct.Struct("!Q")  # every message: its length in bytes, then the bytes
_RANK = struct.Struct("!I")  # a connecting rank first says who it is
CHECK_S = 0.25
"""How often a slow wait asks the watch whether the step is lost."""


@dataclass(frozen=True)
class TcpOptions(TransportOptions):
    """The toy TCP transport's settings (``RefitOptions(transport_options={"toy-tcp": TcpOptions(...)})``).

    - ``chunk_bytes``: the most bytes one ``send`` call hands the kernel (1 MiB).
    - ``nodelay``: disable Nagle's algorithm (True): a step header is sent at once, not batched.
    """

    kind: ClassVar[str] = NAME

    chunk_bytes: int = 1 << 20
    nodelay: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise OptionError(f"TcpOptions.chunk_bytes={self.chunk_bytes!r}: expected a positive integer")
        if not isinstance(self.nodelay, bool):
            raise OptionError(f"TcpOptions.nodelay={self.nodelay!r}: expected True or False")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _read_exact(sock: socket.socket, into: memoryview) -> None:
    while len(into):
        got = sock.recv_into(into)
        if got == 0:
            raise ConnectionError("the peer closed its connection")
        into = into[got:]


@dataclass(eq=False)
class _Message:
    """One posted send or receive, done once its bytes left or landed (``error``: why it failed)."""

    tensor: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class _Pair:
    """The socket to one peer, with a thread per direction working its queue of messages in order."""

    def __init__(self, sock: socket.socket, rank: int, peer: int, chunk_bytes: int) -> None:
        self.sock, self.peer, self.chunk_bytes = sock, peer, chunk_bytes
        self.outgoing: queue.SimpleQueue[_Message | None] = queue.SimpleQueue()
        self.incoming: queue.SimpleQueue[_Message | None] = queue.SimpleQueue()
        for work, direction in ((self._send_loop, "send"), (self._recv_loop, "recv")):
            threading.Thread(target=work, name=f"toy-tcp-{direction}-{rank}-{peer}", daemon=True).start()

    def _send_loop(self) -> None:
        while (message := self.outgoing.get()) is not None:
            try:
                data = _bytes_of(message.tensor)
                self.sock.sendall(_LENGTH.pack(len(data)))
                for start in range(0, len(data), self.chunk_bytes):
                    self.sock.sendall(data[start:start + self.chunk_bytes])
            except OSError as exc:
                message.error = f"send to rank {self.peer} failed: {exc}"
            message.done.set()

    def _recv_loop(self) -> None:
        while (message := self.incoming.get()) is not None:
            try:
                data = _bytes_of(message.tensor)
                header = bytearray(_LENGTH.size)
                _read_exact(self.sock, memoryview(header))
                (length,) = _LENGTH.unpack(header)
                if length != len(data):
                    raise ConnectionError(f"rank {self.peer} sent {length} bytes where {len(data)} were expected "
                                          "(the two ends posted different messages)")
                _read_exact(self.sock, data)
            except (OSError, ConnectionError) as exc:
                message.error = f"receive from rank {self.peer} failed: {exc}"
            message.done.set()

    def close(self) -> None:
        self.outgoing.put(None)
        self.incoming.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes our own threads and tells the peer at once
        except OSError:
            pass
        self.sock.close()


class _TcpFence(Fence):
    """Completion of one exchange's messages, each with the peer it talks to."""

    def __init__(self, messages: list[tuple[int, _Message]], transport: TcpTransport) -> None:
        self.messages, self.transport = messages, transport

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        self.synchronize(self.transport.timeout_s)

    def synchronize(self, timeout_s: float) -> None:
        if self.messages:
            messages, self.messages = self.messages, []
            self.transport._await(messages, timeout_s)


class TcpTransport(Transport):
    """Grouped point-to-point over one TCP socket per pair of ranks (CPU tensors only)."""

    kind = NAME

    def __init__(self, pairs: dict[int, socket.socket], rank: int, timeout_s: float, options: TcpOptions,
                 watch: PeerWatch | None) -> None:
        self.device = torch.device("cpu")
        self.rank, self.timeout_s, self.watch, self.options = rank, timeout_s, watch, options
        self._pairs: dict[int, _Pair] | None = {p: _Pair(s, rank, p, options.chunk_bytes) for p, s in pairs.items()}
        self._broken: str | None = None  # why this transport gave up on a step: it posts nothing more
        self._in_flight = 0  # fences posted and not yet seen complete
        self.registered_bytes = 0

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """TCP copies through the kernel and needs no registration; an RDMA transport would register
        ``tensors`` with its NIC here and publish their keys through the store."""
        self.registered_bytes = sum(t.nbytes for t in tensors)

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = (), *, control: bool = False) -> Fence:
        check_contiguous(sends)
        check_contiguous(recvs)
        for fence in after:
            fence.wait()
        pairs = self._pairs
        if pairs is None or self._broken is not None:
            raise TransferError(f"the toy-tcp transport of rank {self.rank} is closed"
                                + (f" (it gave up on a step: {self._broken})" if self._broken else ""))
        if not sends and not recvs:
            return DoneFence()
        posted: list[tuple[int, _Message]] = []
        for queue_of, items in ((lambda p: p.incoming, recvs), (lambda p: p.outgoing, sends)):
            for peer, tensor in items:
                if peer not in pairs:
                    raise TransferError(f"toy-tcp: rank {self.rank} has no connection to rank {peer}")
                if tensor.device.type != "cpu":
                    raise TransferError(f"toy-tcp moves CPU tensors only, got one on {tensor.device} for rank {peer}")
                message = _Message(tensor)
                queue_of(pairs[peer]).put(message)
                posted.append((peer, message))
        self._in_flight += 1
        return _TcpFence(posted, self)

    def _await(self, messages: list[tuple[int, _Message]], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for peer, message in messages:
            while not message.done.wait(CHECK_S):
                if time.monotonic() > deadline:
                    raise self._give_up(f"toy-tcp exchange between rank {self.rank} and rank {peer} did not "
                                        f"complete within {timeout_s:.0f} s")
                loss = self.watch.lost(peer) if self.watch is not None else None
                if loss is not None:
                    assert self.watch is not None
                    raise self._give_up(f"toy-tcp exchange of rank {self.rank} abandoned: "
                                        f"{loss.describe(self.watch.names)}")
            if message.error is not None:
                raise self._give_up(f"toy-tcp exchange of rank {self.rank}: {message.error}")
        self._in_flight -= 1

    def _give_up(self, reason: str) -> TransferError:
        """Abandon the step: tell the others through the watch (the first to give up is the one they hear
        of), and close every socket so that peers waiting on this rank fail at once."""
        if self._broken is None:
            self._broken = reason
            if self.watch is not None:
                self.watch.give_up(self.rank, reason)
        self._close_pairs()
        return TransferError(reason)

    def abort(self, reason: str) -> None:
        if self._in_flight:
            self._give_up(f"rank {self.rank} left the step ({reason})")
        self.close()

    def close(self) -> None:
        if self._in_flight and self._broken is None:
            self._give_up(f"rank {self.rank} closed its transport with messages in flight")
        self._close_pairs()

    def _close_pairs(self) -> None:
        pairs, self._pairs = self._pairs, None
        for pair in (pairs or {}).values():
            pair.close()


def _listening_host(rendezvous: str | None) -> str:
    """This machine's address on the interface toward the rendezvous (loopback when it is unknown)."""
    if not rendezvous:
        return "127.0.0.1"
    host, _, port = rendezvous.rpartition(":")
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)  # a datagram socket: nothing is sent
        return str(probe.getsockname()[0])


def open_tcp(context: TransportContext) -> TcpTransport:
    """Connect every pair of ranks (collective): lower ranks listen, higher ranks connect."""
    if context.device.type != "cpu":
        raise OptionError(f"the toy-tcp transport moves CPU tensors only; this rank's pieces are on {context.device}")
    options = context.options if isinstance(context.options, TcpOptions) else TcpOptions()
    rank, world, store = context.rank, context.world_size, context.store
    host = _listening_host(context.rendezvous)
    with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                              backlog=world) as listener:
        listener.settimeout(context.timeout_s)
        store.set(f"{NAME}/address/{rank}", f"{host}|{listener.getsockname()[1]}")
        pairs: dict[int, socket.socket] = {}
        try:
            for peer in range(rank):
                peer_host, _, port = store.get(f"{NAME}/address/{peer}").decode().partition("|")
                sock = socket.create_connection((peer_host, int(port)), timeout=context.timeout_s)
                sock.sendall(_RANK.pack(rank))
                pairs[peer] = sock
            for _ in range(rank + 1, world):
                sock, _ = listener.accept()
                sock.settimeout(context.timeout_s)
                said = bytearray(_RANK.size)
                _read_exact(sock, memoryview(said))
                pairs[_RANK.unpack(said)[0]] = sock
        except BaseException:
            for sock in pairs.values():
                sock.close()
            raise
    for sock in pairs.values():
        sock.settimeout(None)  # waits are bounded by the fences, which can also ask the watch
        if options.nodelay:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return TcpTransport(pairs, rank, context.timeout_s, options, context.watch)


TCP = TransportType(NAME, open_tcp, TcpOptions, "CPU tensors over plain TCP sockets (refit's example transport)")
"""The registered kind (entry point ``toy-tcp = "refit_toy.tcp:TCP"``)."""
