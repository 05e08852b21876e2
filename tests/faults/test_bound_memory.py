"""Every bound tensor is checked every step: a rank whose model rebound (``param.data = ...``), ``set_()``,
resized or freed a tensor after setup fails the step naming the tensor, its side and what changed, on every
rank, before any byte moves; never a stale send, a stale engine or freed memory handed to the transport.

Real processes over gloo (2 train + 2 gen ranks, every train rank sends to every gen rank). The plugin hands
each parameter object itself as its piece's view, as the red team's did, with or without
``refit_model_tensors`` (before: without it, each step compared the piece's object with itself). The red
team's fuzz cases ``src_set_storage_after_setup`` and ``dst_set_storage_no_rebind`` are :attr:`Change.SET` on
a train rank and on a gen rank (whose plugin's ``refit_begin_update`` returns False: no rebind).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from harness import Ranks
from memory_faults import Change, MemoryFault, strike

from refit_core import (
    Box,
    DestinationMap,
    DestinationPiece,
    RefitOptions,
    RefitReceiver,
    RefitSender,
    Side,
    SourcePiece,
    TensorSpec,
    hookimpl,
)
from refit_core.contract.plugins import PluginManager
from refit_core.kit.launch import free_port

TRAIN, GEN = 2, 2
SHAPES = {"layer.weight": (8, 4), "norm.weight": (4,)}
CULPRIT = "layer.weight"  # the tensor each change strikes, on one rank
CULPRIT_BYTES = {Side.TRAIN: 64, Side.GEN: 128}  # its storage: 16 float32 on a train rank, 32 on a gen rank


def reference(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s whole weights: distinct values per step, exact in float32."""
    return {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000 * (step + 1)
            for name, shape in SHAPES.items()}


class Model:
    """One rank's parameters: a train rank's row shard of each tensor, a gen rank's whole tensors."""

    def __init__(self, train: bool, rank: int, world: int) -> None:
        self.train = train
        self.offsets: dict[str, tuple[int, ...]] = {}
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, shape in SHAPES.items():
            rows = shape[0] // world if train else shape[0]
            start = rank * rows if train else 0
            self.offsets[name] = (start,) + (0,) * (len(shape) - 1)
            self.params[name] = torch.nn.Parameter(torch.zeros(rows, *shape[1:]), requires_grad=False)

    def load(self, full: dict[str, torch.Tensor], skip: str | None = None) -> None:
        """Copy this rank's part of ``full`` into its parameters, in place (``skip``: one left alone)."""
        for name, param in self.params.items():
            if name != skip:
                param.copy_(full[name].narrow(0, self.offsets[name][0], param.shape[0]))

    def pieces(self, cls: type) -> list:
        return [cls(TensorSpec(name, SHAPES[name], torch.float32), Box(self.offsets[name], tuple(param.shape)), param)
                for name, param in self.params.items()]


class HandsParameters:
    """The pieces' views are the parameter objects themselves; ``lists``: also implements ``refit_model_tensors``."""

    def __init__(self, lists: bool) -> None:
        self.lists = lists

    @hookimpl
    def refit_source_pieces(self, model):
        return model.pieces(SourcePiece) if isinstance(model, Model) and model.train else None

    @hookimpl
    def refit_destination_map(self, model):
        return DestinationMap(model.pieces(DestinationPiece)) if isinstance(model, Model) and not model.train else None

    @hookimpl
    def refit_model_tensors(self, model):
        return list(model.params.items()) if self.lists and isinstance(model, Model) else None

    @hookimpl
    def refit_begin_update(self, model):
        return False if isinstance(model, Model) else None


@dataclass(frozen=True)
class Case:
    change: Change
    lists: bool
    culprit: int  # a global rank: train ranks first
    address: str


def bound_rank(rank: int, report, cases: list[Case]) -> list[dict]:
    """Rank ``rank`` runs every case in turn: set up, one good step, then the culprit's change and a step."""
    outcomes = []
    for case in cases:
        train = rank < TRAIN
        local, size = (rank, TRAIN) if train else (rank - TRAIN, GEN)
        plugins = PluginManager(load_entry_points=False)
        plugins.register(HandsParameters(case.lists), name="hands-parameters")
        model = Model(train, local, size)
        endpoint = (RefitSender if train else RefitReceiver)(
            model, rendezvous=case.address, rank=local, world_size=size, plugins=plugins,
            options=RefitOptions(timeout_s=8, bucket_bytes=1024))
        endpoint.setup()
        outcome: dict = {}
        before: dict[str, torch.Tensor] = {}
        for step in (0, 1):
            hit = step == 1 and rank == case.culprit
            if hit:
                strike(model.params[CULPRIT], case.change)
            if not train and step == 1:  # what the engine holds just before the step
                before = {name: p.clone() for name, p in model.params.items() if p.untyped_storage().nbytes()}
            start = time.monotonic()
            try:
                if train:
                    model.load(reference(step), skip=CULPRIT if hit and case.change is Change.FREE else None)
                    endpoint.send(version=step)
                else:
                    endpoint.receive()
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                outcome.update(step=step, error=type(exc).__name__, message=str(exc),
                               seconds=time.monotonic() - start)
                break
        if not train:
            outcome["unchanged"] = all(torch.equal(model.params[name], held) for name, held in before.items())
        endpoint.close()
        outcomes.append(outcome)
    return outcomes


def run(cases: list[Case]) -> dict[int, list[dict]]:
    ranks = Ranks()
    try:
        for rank in range(TRAIN + GEN):
            ranks.start(bound_rank, rank, cases)
        ranks.release()
        results = ranks.wait_for([(r, "result") for r in range(TRAIN + GEN)], timeout_s=60 + 20 * len(cases))
    finally:
        ranks.close()
    return {rank: results[(rank, "result")] for rank in range(TRAIN + GEN)}


@pytest.mark.slow
@pytest.mark.parametrize("culprit", [0, TRAIN + 1], ids=["train", "gen"])
def test_a_tensor_changed_after_setup_fails_the_step_on_every_rank_naming_it(culprit):
    """Each change, with and without ``refit_model_tensors``: every rank's step 1 fails within its deadline,
    its error names the tensor, the culprit's side and what changed, and no gen rank's bytes moved. Before: a
    rebinding or ``set_()`` was sent (train) or served (gen) stale with success, and freed storage reached
    gloo ("Bad address", or the process aborted)."""
    cases = [Case(change, lists, culprit, f"127.0.0.1:{free_port()}") for lists in (False, True) for change in Change]
    results = run(cases)
    side = Side.TRAIN if culprit < TRAIN else Side.GEN
    for index, case in enumerate(cases):
        fault = MemoryFault(CULPRIT, side, case.change, CULPRIT_BYTES[side])
        for rank, outcomes in results.items():
            outcome = outcomes[index]
            assert outcome.get("step") == 1, (case, rank, outcome)
            assert fault.named_in(outcome["message"]), (case, rank, outcome)
            assert outcome["seconds"] < 8 + 3, (case, rank, outcome)
            if rank >= TRAIN:
                assert outcome["unchanged"], (case, rank, outcome)


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
@pytest.mark.parametrize("change", ["data", "set", "resize", "free", "reused", "view", "object", "count"])
def test_each_change_is_found_and_named_without_a_step(change, compiled):
    """The check alone, on a listing of two tensors: each change found, named and told apart; none when
    the model only updated its tensors in place. In Python, and through the compiled loop
    (``refit_core/endpoints/compiled_check.py``), whose record the first passing check takes."""
    from dataclasses import replace

    from refit_core.endpoints.binding import BoundTensors, CompiledRecord, Moved

    if compiled:
        compiled_check_or_skip()
    param, other = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False), torch.ones(8)
    bound = replace(BoundTensors.listed([("p", param), ("o", other)]), compiled=CompiledRecord(allowed=compiled))
    param.add_(1.0)  # in place: no change
    assert bound.first_change([("p", param), ("o", other)]) is None
    assert (bound.compiled.record is not None) is compiled
    assert bound.first_change([("p", param), ("o", other)]) is None
    now = [("p", param), ("o", other)]
    if change == "data":
        param.data = torch.zeros(4, 4)
    elif change == "set":
        param.set_(torch.zeros(4, 4))
    elif change == "resize":
        param.untyped_storage().resize_(128)
    elif change == "free":
        param.untyped_storage().resize_(0)
    elif change == "reused":  # freed, then other memory at the very address (an allocator's reuse)
        address = param.data_ptr()
        param.untyped_storage().resize_(0)
        param.set_(torch._C._construct_storage_from_data_pointer(address, param.device, 64), 0, (4, 4))  # never read
        assert param.data_ptr() == address  # only the storages' pass sees it
    elif change == "view":
        other.set_(other.untyped_storage(), 2, (6,))
    elif change == "object":
        now = [("p", param), ("o", other.clone())]
    else:
        now = now[:1]
    found = bound.first_change(now)
    expected = {"data": ("p", Moved.STORAGE_REPLACED, ""), "set": ("p", Moved.STORAGE_REPLACED, ""),
                "resize": ("p", Moved.STORAGE_RESIZED, "from 64 to 128 bytes"),
                "free": ("p", Moved.STORAGE_FREED, "(resized from 64 to 0 bytes)"),
                "reused": ("p", Moved.STORAGE_FREED, "(resized from 64 to 0 bytes)"),
                "view": ("o", Moved.VIEW_MOVED, "from byte 0 to byte 8 of its storage"),
                "object": ("o", Moved.OBJECT_REPLACED, ""), "count": ("", Moved.LISTING_CHANGED, "")}[change]
    assert found is not None and (found.name, found.moved) == expected[:2], found
    assert expected[2] in found.detail, found


def compiled_check_or_skip() -> None:
    """Build the compiled check (cached: ``scripts/setup-env.sh`` builds it); skip only without a compiler."""
    import shutil

    from refit_core.endpoints.compiled_check import build

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here: the compiled check cannot be built (the check runs in Python)")
    build()


def test_a_storage_bound_empty_is_checked_too():
    """A tensor without elements, on a storage of 0 bytes: that storage given memory is found."""
    from refit_core.endpoints.binding import BoundTensors, Moved

    empty, other = torch.empty(0), torch.ones(2)
    bound = BoundTensors.listed([("e", empty), ("o", other)])
    empty.untyped_storage().resize_(16)
    found = bound.first_change([("e", empty), ("o", other)])
    assert found is not None and (found.name, found.moved, found.detail) == ("e", Moved.STORAGE_RESIZED,
                                                                             "from 0 to 16 bytes"), found
