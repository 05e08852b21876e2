"""The per-step bound-memory check as one compiled loop, built once per machine, torch and Python.

In Python the check costs one C call per tensor (about 130-180 ns each): 3 ms at 18,867 tensors, where a
step's budget for it is 1 ms. ``compiled_check.cpp`` walks the tensors in one loop instead (about 20 ns a
tensor), comparing each one's storage object, address, size and offset with the bind's record. It is a fast
filter: it answers "all unchanged" or "look at item i", and :mod:`refit_core.endpoints.binding` diagnoses
item i in Python as before, so a wrong "look" costs time, never a wrong verdict.

It is built with torch's C++ extension loader (a C++ compiler and ninja) into torch's extension cache, under a
name that hashes the source, torch's version and Python's: about 20 s, once (:func:`library_path`). A model
bound with at least :data:`BUILD_FROM` tensors starts the build in a background thread when none is cached;
until it is done, and where it cannot be built (no compiler: logged once), the check runs in Python.
:func:`build` builds it in the foreground (``scripts/setup-env.sh`` does, so that tests find it), and
:func:`compiled_check` loads a cached build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger("refit")

SOURCE = Path(__file__).with_name("compiled_check.cpp")
MODULE = "refit_compiled_check"
BUILD_FROM = 1000
"""Tensors in one bind from which a missing build is started in the background (below, Python's check
costs under 0.2 ms a step)."""
LOOK_EVERY_S = 30.0
"""How often a process without the compiled check looks for a build again (one another process made)."""


class CompiledCheck(Protocol):
    """The compiled module's functions (``compiled_check.cpp``)."""

    def record(self, tensors: Sequence[torch.Tensor], /) -> bytes: ...

    def first_moved(self, items: Sequence[object], record: bytes, field: int, /) -> int: ...

    def first_piece_moved(self, pieces: Sequence[object], specs: tuple[object, ...], boxes: tuple[object, ...],
                          viewed: bytes, record: bytes, /) -> int: ...


class _State:
    """This process's build: the module once loaded, the background build's thread, and the last failure."""

    def __init__(self) -> None:
        self.module: CompiledCheck | None = None
        self.builder: threading.Thread | None = None
        self.failure: str | None = None
        self.next_look = 0.0
        """``time.monotonic()`` from which to look for a build again."""
        self.lock = threading.Lock()


_state = _State()


def _forget_after_fork() -> None:
    """A forked child has no builder thread and must not wait on its parent's lock: it starts afresh."""
    global _state
    _state = _State()


os.register_at_fork(after_in_child=_forget_after_fork)


def library_path() -> Path:
    """Where the build for this source, torch and Python lives (whether or not it exists yet): torch's extension
    cache, as torch's own builds (``TORCH_EXTENSIONS_DIR`` where set, else ``torch_extensions`` in the user's
    cache directory)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__}|{sys.version}".encode()).hexdigest()[:16]
    return Path(root) / f"{MODULE}_{key}.so"


def compiled_check(build_from: int = 0) -> CompiledCheck | None:
    """The compiled check if this process has it, or loaded from a cached build; else None. Without one, a
    process looks again at most every :data:`LOOK_EVERY_S`, and when ``build_from`` (the tensors about to be
    checked) reaches :data:`BUILD_FROM` starts a build in the background (once) for a later call to find."""
    state = _state
    if state.module is not None or state.failure is not None or time.monotonic() < state.next_look:
        return state.module
    with state.lock:
        if state.module is None and state.failure is None:
            state.next_look = time.monotonic() + LOOK_EVERY_S
            path = library_path()
            if path.exists():
                try:
                    state.module = _load(path)
                except ImportError as exc:
                    state.failure = f"{path}: {exc}"
                    log.warning("refit: the compiled bound-memory check at %s does not load (%s); the check runs "
                                "in Python (delete the file to build it again)", path, exc)
            elif build_from >= BUILD_FROM and state.builder is None:
                state.builder = threading.Thread(target=_build_quietly, args=(state,), name="refit-compiled-check",
                                                 daemon=True)
                state.builder.start()
    return state.module


def build() -> CompiledCheck:
    """Build the compiled check now (or load the cached build); raises what the build raised."""
    path = library_path()
    if not path.exists():
        with _exclusive(path.with_suffix(".lock")):
            if not path.exists():
                _compile_into(path)
    module = _load(path)
    _state.module = module
    return module


def _build_quietly(state: _State) -> None:
    try:
        module = build()
    except Exception as exc:  # noqa: BLE001 - any failure to build leaves the Python check, which is correct
        state.failure = f"{type(exc).__name__}: {exc}"
        log.warning("refit: the compiled bound-memory check could not be built (%s); the check runs in Python "
                    "(about 150 ns a tensor)", str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
        return
    state.module = module


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold ``lock`` (an ``flock``: released if this process dies, so a killed build blocks nobody)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile_into(path: Path) -> None:
    """Compile in a directory of this process's own, then move the library into place in one rename."""
    from torch.utils.cpp_extension import load

    work = Path(tempfile.mkdtemp(prefix=f"{MODULE}-", dir=path.parent))
    try:
        load(name=MODULE, sources=[str(SOURCE)], extra_cflags=["-O2"], build_directory=str(work),
             is_python_module=True, verbose=False)
        os.replace(work / f"{MODULE}.so", path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load(path: Path) -> CompiledCheck:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


__all__ = ["BUILD_FROM", "CompiledCheck", "build", "compiled_check", "library_path"]
