"""The compiled per-step check of the bound memory (``refit_core/endpoints/compiled_check.py``): it proves every
tensor unchanged, or points at the first it cannot, and the check in Python names what changed. A plugin's
pieces (no ``refit_model_tensors``) are checked by spec, box and view; any mix of changes is found exactly
where the check in Python finds it; and where the loop cannot be built the check stays in Python, correct.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from memory_faults import Change, strike
from test_bound_memory import compiled_check_or_skip

from refit_core import Box, SourcePiece, TensorSpec
from refit_core.endpoints import compiled_check
from refit_core.endpoints.binding import BoundMemory, BoundTensors, CompiledRecord, Moved


def pieces_of(tensors: list[torch.Tensor]) -> list[SourcePiece]:
    return [SourcePiece(TensorSpec(f"t{i}", tuple(t.shape), t.dtype), Box((0,) * t.dim(), tuple(t.shape)), t)
            for i, t in enumerate(tensors)]


def compiled_memory(pieces: list[SourcePiece]) -> BoundMemory:
    """A bind of ``pieces`` (no listing hook) whose check has taken the compiled record."""
    memory = BoundMemory.after_bind([], [], None, pieces)
    assert memory.first_piece_change(pieces) is None
    assert memory.identity.compiled.record is not None
    return memory


@pytest.mark.parametrize("change", ["spec", "box", "view", "memory", "view_dropped", "count"])
def test_a_plugins_pieces_changed_are_found_by_the_compiled_loop(change):
    compiled_check_or_skip()
    tensors = [torch.ones(4, 2), torch.ones(3)]
    pieces = pieces_of(tensors)
    memory = compiled_memory(pieces)
    now = [replace(p) for p in pieces]  # new piece objects, equal: no change
    assert memory.first_piece_change(now) is None
    if change == "spec":
        now[1] = SourcePiece(TensorSpec("renamed", (3,), torch.float32), now[1].box, now[1].view)
    elif change == "box":
        now[0] = SourcePiece(TensorSpec("t0", (8, 2), torch.float32), Box((4, 0), (4, 2)), now[0].view)
    elif change == "view":
        now[1] = replace(now[1], view=tensors[1].clone())
    elif change == "memory":
        tensors[0].data = tensors[0].clone()
    elif change == "view_dropped":
        now[0].view = None
    else:
        now = now[:1]
    found = memory.first_piece_change(now)
    assert found is not None
    expected = {"view": ("t1", Moved.STORAGE_REPLACED), "memory": ("t0", Moved.STORAGE_REPLACED),
                "view_dropped": ("t0", Moved.OBJECT_REPLACED)}
    assert (found.name, found.moved) == expected.get(change, ("", Moved.LISTING_CHANGED)), found


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([None, *Change]), min_size=1, max_size=6), st.booleans())
def test_any_mix_of_changes_is_found_where_python_finds_it(changes, listed):
    """The compiled loop and the check in Python agree on every mix of changes: the same first tensor named,
    the same way (the compiled loop only points; Python names)."""
    compiled_check_or_skip()
    tensors = [torch.nn.Parameter(torch.full((2, 2), float(i)), requires_grad=False) for i in range(len(changes))]
    named = [(f"t{i}", t) for i, t in enumerate(tensors)]
    python = replace(BoundTensors.listed(named), compiled=CompiledRecord(allowed=False))
    compiled = BoundTensors.listed(named)
    assert compiled.first_change(named) is None and compiled.compiled.record is not None
    for tensor, change in zip(tensors, changes):
        if change is not None:
            strike(tensor, change)
    if listed:
        assert compiled.first_change(named) == python.first_change(named)
    else:
        assert compiled.first_change_of(tensors) == python.first_change_of(tensors)
    if all(change is None for change in changes):
        assert compiled.compiled.check is not None
        assert compiled.compiled.check.first_moved(named, compiled.compiled.record, 1) == -1


def test_where_the_loop_cannot_be_built_the_check_stays_in_python(tmp_path, monkeypatch, caplog):
    """A build that fails (here: a source that does not compile) is logged once; binds of any size go on
    checking in Python, and find a change."""
    broken = tmp_path / "compiled_check.cpp"
    broken.write_text('#error "this machine cannot build the compiled check"\n')
    monkeypatch.setattr(compiled_check, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))  # torch's own: where builds go
    monkeypatch.setattr(compiled_check, "_state", compiled_check._State())
    tensors = [torch.ones(1) for _ in range(compiled_check.BUILD_FROM)]
    named = [(f"t{i}", t) for i, t in enumerate(tensors)]
    bound = BoundTensors.listed(named)
    with caplog.at_level("WARNING", logger="refit"):
        assert bound.first_change(named) is None  # starts the build, checks in Python
        builder = compiled_check._state.builder
        assert isinstance(builder, threading.Thread)
        builder.join(timeout=120)
    assert not builder.is_alive() and compiled_check._state.failure is not None
    assert "could not be built" in caplog.text
    assert compiled_check.compiled_check(build_from=compiled_check.BUILD_FROM) is None  # not tried again
    tensors[-1].data = torch.zeros(1)
    found = bound.first_change(named)
    assert bound.compiled.record is None and found is not None and found.name == f"t{len(tensors) - 1}"
