"""A module tree's parameters and buffers, listed cheaply before every step (``refit_model_tensors``).

``named_parameters()`` / ``named_buffers()`` walk every submodule through generators and build every
name anew: about 0.9 ms on a 32-layer megatron-core ``GPTModel`` (CPU), on the critical path of every
step. :class:`ModuleTensors` walks once, then reads each tensor from its module's slot; it walks again
when a submodule on the way to a listed tensor was replaced or a slot emptied, so the listing is what the
walk would give for every module that held tensors when it walked.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import is_, is_not

import torch


class ModuleTensors:
    """The parameters, then the buffers (unless ``buffers=False``), of ``roots`` (each named ``PREFIX.NAME``), in
    walk order.

    Calling it returns the tensors in their slots now, so a parameter replaced with a new tensor, or
    given new memory, shows up (the core compares each with what it bound). A replaced submodule that
    holds listed tensors (or one on the way to them), or an emptied slot, makes the next call walk again.
    Submodules that held no tensors at the walk (activations, dropouts, identities: about half of a
    megatron-core layer's) are not watched: what replaces them is not listed until the next walk. A
    tensor shared by two slots is listed once, as ``named_parameters()`` lists it.
    """

    def __init__(self, roots: Sequence[tuple[str, torch.nn.Module]], buffers: bool = True) -> None:
        """``buffers``: False lists the parameters alone (buffers a forward may replace, like a dynamic rotary
        embedding's ``inv_freq``, are then no concern of the check)."""
        self.roots = list(roots)
        self.buffers = buffers
        self.walks = 0
        """How many times the trees were walked (1 while nothing structural changed)."""
        # columns, each read in one pass of C calls (``map``): a slot is ``tables[i][keys[i]]``, a link
        # ``modules[i][names[i]] is children[i]`` (a parent's child at the time of the walk)
        self._names: list[str] = []
        self._tables: list[dict[str, torch.Tensor | None]] = []
        self._keys: list[str] = []
        self._modules: list[dict[str, torch.nn.Module | None]] = []
        self._child_names: list[str] = []
        self._children: list[torch.nn.Module] = []

    def _walk(self) -> None:
        slots: dict[str, list[tuple[str, dict[str, torch.Tensor | None], str]]] = {"_parameters": []}
        if self.buffers:
            slots["_buffers"] = []
        seen: dict[str, set[int]] = {kind: set() for kind in slots}
        holders: set[int] = set()  # the modules holding a listed tensor, or a submodule that does
        modules: list[torch.nn.Module] = []
        for prefix, root in self.roots:
            for path, module in root.named_modules():
                modules.append(module)
                for kind, listed in slots.items():
                    table = getattr(module, kind)
                    for key, tensor in table.items():
                        if tensor is not None and id(tensor) not in seen[kind]:
                            seen[kind].add(id(tensor))
                            listed.append((".".join(p for p in (prefix, path, key) if p), table, key))
                            holders.add(id(module))
        for module in reversed(modules):  # a module after every one of its submodules
            if any(id(child) in holders for child in module._modules.values()):
                holders.add(id(module))
        links = [(module._modules, key, child) for module in modules for key, child in module._modules.items()
                 if child is not None and id(child) in holders]
        every = slots["_parameters"] + slots.get("_buffers", [])
        self._names = [name for name, _, _ in every]
        self._tables = [table for _, table, _ in every]
        self._keys = [key for _, _, key in every]
        self._modules = [parent for parent, _, _ in links]
        self._child_names = [key for _, key, _ in links]
        self._children = [child for _, _, child in links]
        self.walks += 1

    def _current(self) -> bool:
        return self.walks > 0 and all(map(is_, map(dict.get, self._modules, self._child_names), self._children))

    def __call__(self) -> list[tuple[str, torch.Tensor]]:
        if not self._current():
            self._walk()
        tensors = list(map(dict.get, self._tables, self._keys))
        if not all(map(is_not, tensors, repeat(None))):
            self._walk()
            tensors = list(map(dict.get, self._tables, self._keys))
        return list(zip(self._names, tensors))  # type: ignore[arg-type]  # no None: checked just above


__all__ = ["ModuleTensors"]
