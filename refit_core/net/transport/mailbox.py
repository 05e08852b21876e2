"""A per-pair mailbox in host shared memory: the colocated step's *ready* and *done* signals.

Colocated ranks share a host by definition, so their per-step signals need no network and no
store: the train rank creates one page of shared memory per colocated peer at setup (opened by the
peer through :mod:`refit_core.net.transport.memory`), and each step writes a header there and waits for
the peer's acknowledgement. Either side outliving the other still reads what it wrote (a failing
train rank's reason reaches its engine even if the train rank has exited, and even if it hosted the
rendezvous store).

Layout (int64 words, then two UTF-8 message areas): ``[0]`` ready sequence (step + 1), ``[1]``
version, ``[2]`` plan fingerprint, ``[3]`` sender error length, ``[4]`` 1 if a verdict follows the
ready signal (the trainer checks its memory while the engine already copies), ``[5]`` verdict
sequence (step + 1; its error in the sender's area); ``[8]`` done sequence, ``[9]`` receiver error
length. A writer fills payload words first and the sequence word last; x86 keeps
stores in order, and each read or write of a word is one native load or store (a ctypes array over the
page: a few tens of nanoseconds, where a tensor index costs microseconds). Only plain integers and
UTF-8 text are read back, never pickled objects.

A waiting side spins (yielding its CPU) for up to ``spin_s`` before it sleeps 50 us between looks: a
GPU pair's signals arrive within the step's few milliseconds, and each sleep would add up to a tenth
of a millisecond to the step.
"""

from __future__ import annotations

import ctypes
import time

import torch

from refit_core.contract.errors import TransferError

PAGE = 4096
_READY, _VERSION, _FINGERPRINT, _SEND_ERROR, _PENDING, _VERDICT = 0, 1, 2, 3, 4, 5
_DONE, _RECV_ERROR = 8, 9
_SEND_TEXT, _RECV_TEXT, _TEXT_BYTES = 128, 128 + 1984, 1984
_WORDS = _SEND_TEXT // 8
SPIN_S = 0.002
"""How long a wait spins before it sleeps between looks, by default (a CPU pair: the CPUs are the copiers)."""
GPU_SPIN_S = 0.05
"""How long a GPU pair's wait spins: longer than a colocated step's copies of a large model."""


class Mailbox:
    """Signals between the two ranks of one colocated pair, over one page of shared memory."""

    def __init__(self, page: torch.Tensor, timeout_s: float, peer: str, spin_s: float = SPIN_S) -> None:
        if page.dtype != torch.uint8 or page.numel() != PAGE or page.device.type != "cpu" or not page.is_contiguous():
            raise ValueError("a mailbox is one page of contiguous CPU uint8 memory")
        self.page = page  # keeps the memory the words below point into alive
        self.words = (ctypes.c_int64 * _WORDS).from_address(page.data_ptr())
        self.timeout_s = timeout_s
        self.peer = peer
        self.spin_s = spin_s

    @staticmethod
    def allocate() -> torch.Tensor:
        return torch.zeros(PAGE, dtype=torch.uint8)

    def _write_text(self, start: int, length_word: int, text: str | None) -> None:
        raw = (text or "").encode()[:_TEXT_BYTES]
        if raw:
            self.page[start:start + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.words[length_word] = len(raw)

    def _read_text(self, start: int, length_word: int) -> str | None:
        length = min(max(self.words[length_word], 0), _TEXT_BYTES)  # the peer's word: never trusted
        return bytes(self.page[start:start + length].tolist()).decode(errors="replace") if length else None

    def _await(self, word: int, value: int, what: str) -> None:
        words = self.words
        if words[word] >= value:
            return
        now = time.monotonic()
        deadline, spinning = now + self.timeout_s, now + self.spin_s
        while words[word] < value:
            now = time.monotonic()
            if now > deadline:
                raise TransferError(f"{what} did not arrive within {self.timeout_s:.0f} s ({self.peer} died or hung)")
            time.sleep(0 if now < spinning else 5e-5)

    # -- the train rank --------------------------------------------------------------------------

    def post(self, step: int, version: int, fingerprint: int, error: str | None, verdict: bool = False) -> None:
        """Step ``step``'s weights are ready as ``version`` (or, with ``error``, will not be); with
        ``verdict``, :meth:`post_verdict` follows (the engine must wait for it before its *done*)."""
        self.words[_VERSION] = version
        self.words[_FINGERPRINT] = fingerprint
        self._write_text(_SEND_TEXT, _SEND_ERROR, error)
        self.words[_PENDING] = int(verdict)
        self.words[_READY] = step + 1

    def post_verdict(self, step: int, error: str | None) -> None:
        """The trainer's check of step ``step`` (posted with ``verdict=True``): None if it passed."""
        self._write_text(_SEND_TEXT, _SEND_ERROR, error)
        self.words[_VERDICT] = step + 1

    def wait_done(self, step: int) -> str | None:
        """Block until the engine finished step ``step``; its error, if it failed."""
        self._await(_DONE, step + 1, f"{self.peer}'s completion of colocated step {step}")
        return self._read_text(_RECV_TEXT, _RECV_ERROR)

    # -- the gen rank ----------------------------------------------------------------------------

    def wait_ready(self, step: int) -> tuple[int, int, str | None, bool]:
        """Block until the trainer posted step ``step``: ``(version, fingerprint, error, verdict
        follows)``."""
        self._await(_READY, step + 1, f"{self.peer}'s colocated step {step}")
        if self.words[_READY] != step + 1:
            return -1, -1, (f"{self.peer} is at colocated step {self.words[_READY] - 1}, this rank at "
                            f"{step}: the two sides' steps diverged"), False
        if self.words[_PENDING]:  # the error area is the verdict's now: read it in wait_verdict only
            return self.words[_VERSION], self.words[_FINGERPRINT], None, True
        return self.words[_VERSION], self.words[_FINGERPRINT], self._read_text(_SEND_TEXT, _SEND_ERROR), False

    def wait_verdict(self, step: int) -> str | None:
        """Block until the trainer's verdict on step ``step``; its error, if its check failed."""
        self._await(_VERDICT, step + 1, f"{self.peer}'s check of colocated step {step}")
        return self._read_text(_SEND_TEXT, _SEND_ERROR)

    def done(self, step: int, error: str | None) -> None:
        self._write_text(_RECV_TEXT, _RECV_ERROR, error)
        self.words[_DONE] = step + 1


__all__ = ["GPU_SPIN_S", "PAGE", "SPIN_S", "Mailbox"]
