"""The fault campaign's memory strikes (``campaign.py``): between its two steps, one rank of the toy refit (a
train or a gen rank) rebinds, ``set_()``s, resizes or frees one of its model's tensors (:class:`Change`), right
before its refit call of the second step (a trainer has loaded that step's weights: a freed tensor could not
take them). Every rank's plugin lists the model's tensors (``refit_model_tensors``), or, in some runs, no
plugin does and the steps compare the pieces (the toy plugin's pieces slice qkv: torch refuses a slice of
freed storage in the plugin's own hook, before refit can name it, so those runs free another tensor). The
step must fail on every rank naming the tensor, its side and what changed (:class:`MemoryFault`), the struck
rank moving no byte; the recovery (setup again) refits bitwise."""

from __future__ import annotations

import copy
import functools
import random
from dataclasses import dataclass
from types import ModuleType

import torch
from fault_ranks import _state
from memory_faults import Change, MemoryFault, heal, nbytes, strike
from refit_toy.models import GROUPED_EXPERTS, ToyEngine, ToyTrainer

from refit_core import RefitSender, Side
from refit_core.contract.plugins import PluginManager

GEN_TENSORS = {
    "embed": ("model.embed_tokens.weight", "model.embed_tokens.weight"),
    "qkv": ("qkv", "model.layers.0.self_attn.q_proj.weight"),
    "experts_up": ("experts_up", GROUPED_EXPERTS),
    "norm": ("model.norm.weight", "model.norm.weight"),
}
"""A toy engine's tensors by attribute: the name the toy plugin's ``refit_model_tensors`` lists it by, and the
name of the first piece viewing it (what a step names without that hook)."""


@dataclass(frozen=True)
class MemoryStrike:
    """One rank's model changes one of its tensors behind refit's back, right before its second step."""

    rank: int
    """Global rank: train ranks first."""
    train: int
    """How many train ranks the job has (the first ranks)."""
    change: Change
    tensor: str
    """A train rank's shard name, or a gen rank's :data:`GEN_TENSORS` attribute."""
    lists: bool
    """Whether every rank's plugin lists the model's tensors (``refit_model_tensors``); else steps compare pieces."""

    @property
    def side(self) -> Side:
        return Side.TRAIN if self.rank < self.train else Side.GEN

    def describe(self) -> str:
        how = "listed" if self.lists else "pieces"
        return f"{self.change.value} {self.side} rank {self.rank}'s {self.tensor} ({how})"

    def fault(self, gen: int) -> MemoryFault:
        """The error every rank's second step must raise (``gen``: the job's gen ranks)."""
        if self.side is Side.TRAIN:
            name, model = self.tensor, ToyTrainer(self.rank, self.train, device="meta")
        else:
            name, model = GEN_TENSORS[self.tensor][0 if self.lists else 1], ToyEngine(self.rank - self.train, gen,
                                                                                      device="meta")
        return MemoryFault(name, self.side, self.change, nbytes(self.target(model)))

    def target(self, model: ToyTrainer | ToyEngine) -> torch.Tensor:
        """The tensor this strike changes in ``model``."""
        return model.shards[self.tensor][1] if isinstance(model, ToyTrainer) else getattr(model, self.tensor)


def random_strike(rng: random.Random, train: int, gen: int) -> MemoryStrike:
    """A random memory strike: its rank, its change, the tensor, with or without ``refit_model_tensors``."""
    rank = rng.randrange(train + gen)
    change, lists = rng.choice(list(Change)), rng.random() < 0.5
    if rank < train:
        tensors = sorted(ToyTrainer(rank, train, device="meta").shards)
    else:  # the toy plugin's pieces slice qkv: torch refuses a slice of freed storage in the plugin's own hook
        tensors = sorted(t for t in GEN_TENSORS if lists or change is not Change.FREE or t != "qkv")
    return MemoryStrike(rank, train, change, rng.choice(tensors), lists)


@functools.cache
def plugins(lists: bool) -> PluginManager | None:
    """The plugins of every rank: None (the toy plugin as installed, which lists the model's tensors), or the
    toy plugin's hooks without ``refit_model_tensors``."""
    if lists:
        return None
    import refit_toy.plugin as toy

    unlisted = ModuleType("toy_unlisted")
    vars(unlisted).update({name: getattr(toy, name) for name in dir(toy)
                           if name.startswith("refit_") and name != "refit_model_tensors"})
    manager = PluginManager(load_entry_points=False)
    manager.register(unlisted, name="toy-unlisted")
    return manager


def arm(endpoint, model: ToyTrainer | ToyEngine, strike_: MemoryStrike) -> None:
    """Make the strike land when the endpoint's next step starts, before refit looks at the model."""
    name = "send" if isinstance(endpoint, RefitSender) else "receive"
    real = getattr(endpoint, name)

    def struck(*args, **kwargs):
        strike(strike_.target(model), strike_.change)
        return real(*args, **kwargs)
    setattr(endpoint, name, struck)


def recover(model: ToyTrainer | ToyEngine) -> None:
    """The model gives every tensor it freed memory again, as before its next use (the recovery's setup binds it)."""
    tensors = ([view for _, view in model.shards.values()] if isinstance(model, ToyTrainer) else
               [getattr(model, attr) for attr in GEN_TENSORS])
    for tensor in tensors:
        heal(tensor)


def held(engine: ToyEngine, receiver) -> dict[str, str]:
    """What each destination tensor holds (``fault_ranks._state``: "old", "new" or "mixed"), "freed" for the
    pieces of a tensor whose storage was freed (reading them would fault)."""
    freed = [attr for attr in GEN_TENSORS if getattr(engine, attr).untyped_storage().nbytes() == 0]
    if not freed:
        return _state(engine, receiver)
    readable = copy.copy(engine)
    for attr in freed:
        setattr(readable, attr, torch.full_like(getattr(engine, attr), float("nan")))
    stand_ins = {getattr(readable, attr).untyped_storage().data_ptr() for attr in freed}
    gone = {p.spec.name for p in receiver.plugins.destination_map(readable).pieces
            if p.view.untyped_storage().data_ptr() in stand_ins}
    return {name: "freed" if name in gone else state for name, state in _state(readable, receiver).items()}


__all__ = ["GEN_TENSORS", "MemoryStrike", "arm", "held", "plugins", "random_strike", "recover"]
