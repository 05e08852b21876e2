"""Property-based fuzz of piece metadata: whatever a plugin hands refit, at setup or after it, every
rank ends within its deadline with a bitwise-correct refit or a refit error; never a hang, never a
crash once the transport is open, never silently wrong data.

Both sides run as threads of this process (real sockets, a real gloo group): hundreds of refits
would not fit CI's time as separate processes, and the property concerns metadata handling only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from refit_toy import plugin as toy
from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitError, RefitOptions, RefitReceiver, RefitSender, hookimpl
from refit_core.contract.pieces import DestinationMap, DestinationPiece, SourcePiece
from refit_core.contract.plugins import PluginManager
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.launch import free_port
from refit_core.kit.verify import mismatches

DEADLINE_S = 8.0
MUTATIONS = ["none", "view_dtype", "view_shape", "stride0", "share_memory", "name_not_str", "infinite_shape",
             "negative_offset", "box_outside", "drop_piece", "duplicate_piece", "spec_dtype", "rename",
             "meta_view", "not_a_tensor"]


def mutate(pieces: list, kind: str, index: int, cls: type) -> list:
    """``pieces`` with one mutation applied *after* construction, as a buggy plugin would."""
    pieces = list(pieces)
    i = index % len(pieces)
    p = pieces[i]
    if kind == "view_dtype":
        p.view = p.view.view(torch.int32) if p.view.dtype == torch.float32 else p.view.float()
    elif kind == "view_shape":
        p.view = p.view.narrow(0, 0, max(0, p.view.shape[0] - 1))
    elif kind == "stride0":
        p.view = p.view.flatten()[:1].expand(p.view.shape) if p.view.numel() else p.view
    elif kind == "share_memory" and cls is DestinationPiece:  # sources may share memory (tied weights)
        j = (i + 1) % len(pieces)
        other = pieces[j]
        if other.view.numel() >= p.view.numel() and other.view.dtype == p.view.dtype:
            p.view = other.view.flatten()[:p.view.numel()].view(p.view.shape)
    elif kind == "name_not_str":
        object.__setattr__(p.spec, "name", 12345)
    elif kind == "infinite_shape":
        object.__setattr__(p.spec, "shape", (10 ** 30,) + p.spec.shape[1:])
    elif kind == "negative_offset":
        object.__setattr__(p.box, "offsets", (-1,) + p.box.offsets[1:])
    elif kind == "box_outside":
        object.__setattr__(p.box, "offsets", (p.spec.shape[0],) + p.box.offsets[1:])
    elif kind == "drop_piece":
        pieces.pop(i)
    elif kind == "duplicate_piece":
        pieces.append(cls(p.spec, p.box, p.view))
    elif kind == "spec_dtype":
        object.__setattr__(p.spec, "dtype", torch.float16)
    elif kind == "rename":
        object.__setattr__(p.spec, "name", p.spec.name + ".typo")
    elif kind == "meta_view":
        p.view = torch.empty(p.view.shape, dtype=p.view.dtype, device="meta")
    elif kind == "not_a_tensor":
        p.view = p.view.tolist()
    return pieces


@dataclass(frozen=True)
class Case:
    side: str  # which side's plugin misbehaves
    kind: str
    index: int
    after_setup: bool  # the mutation appears only when views are bound again (gen side)


class FuzzPlugin:
    """The toy plugin's pieces, mutated per ``case`` (registered ahead of the toy plugin)."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.calls = 0

    def _mutated(self, pieces: list, side: str, cls: type, setup: bool) -> list:
        c = self.case
        if c.side != side or c.kind == "none" or (side == "gen" and c.after_setup == setup):
            return pieces
        return mutate([cls(TensorSpec(p.spec.name, p.spec.shape, p.spec.dtype), Box(p.box.offsets, p.box.sizes),
                           p.view) for p in pieces], c.kind, c.index, cls)

    @hookimpl(tryfirst=True)
    def refit_source_pieces(self, model):
        if not isinstance(model, ToyTrainer):
            return None
        return self._mutated(toy.refit_source_pieces(model), "train", SourcePiece, True)

    @hookimpl(tryfirst=True)
    def refit_destination_map(self, model):
        if not isinstance(model, ToyEngine):
            return None
        self.calls += 1
        mapping = toy.refit_destination_map(model)
        return DestinationMap(self._mutated(mapping.pieces, "gen", DestinationPiece, self.calls == 1))

    @hookimpl(tryfirst=True)
    def refit_begin_update(self, model):
        return True if isinstance(model, ToyEngine) else None  # re-ask for views every step


def _run_side(results: dict, side: str, address: str, pm: PluginManager) -> None:
    start = time.monotonic()
    options = RefitOptions(timeout_s=DEADLINE_S, bucket_bytes=2048)
    try:
        if side == "train":
            model = ToyTrainer(0, 1)
            endpoint = RefitSender(model, rendezvous=address, rank=0, world_size=1, options=options, plugins=pm)
            endpoint.setup()
            model.load(reference(0, 3))
            endpoint.send(version=3)
        else:
            model = ToyEngine(0, 1)
            endpoint = RefitReceiver(model, rendezvous=address, rank=0, world_size=1, options=options, plugins=pm)
            endpoint.setup()
            endpoint.receive()
            results["mismatches"] = mismatches(toy.refit_destination_map(model).pieces, reference(0, 3))
        endpoint.close()
        results[side] = None
    except BaseException as exc:  # noqa: BLE001 - the property inspects it
        results[side] = exc
        results[f"{side}_opened"] = getattr(endpoint, "schedule", None) is not None if "endpoint" in locals() else False
        try:
            endpoint.close()
        except Exception:  # noqa: BLE001
            pass
    results[f"{side}_seconds"] = time.monotonic() - start


def refit_once(case: Case) -> dict:
    pm = PluginManager(load_entry_points=False)
    pm.register(toy, name="toy")
    pm.register(FuzzPlugin(case), name="fuzz")
    address = f"127.0.0.1:{free_port()}"
    results: dict = {}
    threads = [threading.Thread(target=_run_side, args=(results, side, address, pm), daemon=True)
               for side in ("train", "gen")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * DEADLINE_S)
    results["hung"] = any(t.is_alive() for t in threads)
    return results


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)
@given(side=st.sampled_from(["train", "gen"]), kind=st.sampled_from(MUTATIONS),
       index=st.integers(0, 20), after_setup=st.booleans())
def test_fuzzed_piece_metadata_never_hangs_crashes_or_corrupts(side, kind, index, after_setup):
    case = Case(side, kind, index, after_setup)
    r = refit_once(case)
    assert not r["hung"], (case, r)
    for s in ("train", "gen"):
        exc = r[s]
        # at most two waits of one deadline (setup, then the step), plus a loaded 2-core box's slack
        assert r[f"{s}_seconds"] < 3 * DEADLINE_S, (case, s, r)
        if exc is None:
            continue
        if r.get(f"{s}_opened"):  # after the transport opened, only refit's own errors
            assert isinstance(exc, RefitError), (case, s, repr(exc))
        else:
            assert isinstance(exc, (RefitError, ValueError, TypeError, OverflowError)), (case, s, repr(exc))
    if r["train"] is None and r["gen"] is None:  # accepted: then bitwise right
        assert r["mismatches"] == [], (case, r["mismatches"])
    else:
        assert r["train"] is not None and r["gen"] is not None, (case, r)  # both sides learn of a failure
