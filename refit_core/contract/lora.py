"""LoRA adapters: what both sides agree on when a refit moves adapters, or merges them on the way.

An adapter's tensors travel under the names of a PEFT adapter checkpoint (``adapter_model.safetensors``)
with PEFT's ``base_model.model.`` prefix removed: ``model.layers.0.self_attn.q_proj.lora_A.weight``
(shape ``[rank, in_features]``) and ``...q_proj.lora_B.weight`` (shape ``[out_features, rank]``). Their
values are PEFT's own, unscaled: an engine that folds ``alpha / rank`` into B does so on its side.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

from refit_core.contract.errors import OptionError
from refit_core.contract.pieces import DestinationMap, SourcePiece

LORA_A = "lora_A"
LORA_B = "lora_B"

TARGET_ALIASES: dict[str, str] = {
    "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
    "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
}
"""Short spellings of the usual HF linear modules (``refit plan --lora targets=q,k,v``)."""

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear module of a Llama-style decoder layer."""

_ADAPTER_NAME = re.compile(rf"^(?P<module>.+)\.(?P<half>{LORA_A}|{LORA_B})\.weight$")


class LoraMode(StrEnum):
    """How a refit delivers a LoRA-trained model."""

    ADAPTER = "adapter"
    """Only the adapter tensors move, into the engine's LoRA slots for a named adapter."""
    MERGED = "merged"
    """The sender folds ``W + scale * B @ A`` into each box it packs; the engine gets plain weights."""


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's shape: its engine-side name, rank, alpha and the modules it targets.

    ``targets`` are module short names as PEFT's ``target_modules`` spells them (``q_proj``); an
    HF module is targeted when its last name component is one of them.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] = ALL_LINEAR
    name: str = "refit"
    """The adapter's name in the engine (vLLM's ``LoRARequest.lora_name``, SGLang's ``lora_name``)."""
    mode: LoraMode = LoraMode.ADAPTER

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise OptionError(f"LoraSpec.rank must be positive, got {self.rank}")
        if not self.targets:
            raise OptionError("LoraSpec.targets is empty: name at least one module (q_proj, ...)")
        object.__setattr__(self, "targets", tuple(TARGET_ALIASES.get(t, t) for t in self.targets))

    @property
    def scale(self) -> float:
        """PEFT's scaling of ``B @ A`` (``lora_alpha / r``; rsLoRA is not supported)."""
        return self.alpha / self.rank

    def targets_module(self, module: str) -> bool:
        """True if the HF module path ``module`` (``model.layers.0.self_attn.q_proj``) is adapted."""
        return module.rsplit(".", 1)[-1] in self.targets

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """Read ``r=16,alpha=32,targets=q,k,v,o,gate,up,down`` (alpha defaults to 2 r; ``mode=merged``).

        Raises :class:`~refit_core.OptionError` naming the key at fault."""
        fields: dict[str, str] = {}
        key = ""
        for part in text.split(","):
            if "=" in part:
                key, value = part.split("=", 1)
                key = key.strip()
                if key in fields:
                    raise OptionError(f"--lora gives {key} twice: {text!r}")
                fields[key] = value.strip()
            elif key == "targets":
                fields[key] += "," + part.strip()
            else:
                raise OptionError(f"--lora part {part!r} is not key=value: {text!r}")
        unknown = set(fields) - {"r", "rank", "alpha", "targets", "name", "mode"}
        if unknown:
            raise OptionError(f"--lora has unknown keys {sorted(unknown)}: expected r, alpha, targets, name, mode")
        try:
            rank = int(fields.get("r", fields.get("rank", "")))
        except ValueError:
            raise OptionError(f"--lora needs an integer r=..., got {text!r}") from None
        try:
            alpha = float(fields.get("alpha", 2 * rank))
        except ValueError:
            raise OptionError(f"--lora alpha must be a number, got {fields['alpha']!r}") from None
        try:
            mode = LoraMode(fields.get("mode", LoraMode.ADAPTER))
        except ValueError:
            raise OptionError(f"--lora mode must be one of {[m.value for m in LoraMode]}, got {fields['mode']!r}") \
                from None
        targets = tuple(t for t in fields.get("targets", ",".join(ALL_LINEAR)).split(",") if t)
        return cls(rank=rank, alpha=alpha, targets=targets, name=fields.get("name", "refit"), mode=mode)


@dataclass(frozen=True)
class AdapterTensorName:
    """An adapter tensor's name read apart: the HF module it adapts and which half (A or B)."""

    module: str
    half: str
    """:data:`LORA_A` or :data:`LORA_B`."""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.half}.weight"

    @classmethod
    def read(cls, name: str) -> AdapterTensorName | None:
        """The parts of ``name``, or None if it is not an adapter tensor's name."""
        match = _ADAPTER_NAME.match(name)
        return None if match is None else cls(match["module"], match["half"])


def adapter_tensor_names(module: str) -> tuple[str, str]:
    """The names A and B of the adapter on HF module ``module``."""
    return AdapterTensorName(module, LORA_A).name, AdapterTensorName(module, LORA_B).name


@dataclass(frozen=True)
class LoraFactors:
    """One adapted module's whole adapter, as one rank sees it for a step: ``a`` ``[rank, in]``,
    ``b`` ``[out, rank]`` (plain tensors, PEFT's values and dtype)."""

    a: torch.Tensor
    b: torch.Tensor


class AdapterFactors(Protocol):
    """Where a merged-mode source gets its adapters each step (a plugin implements it).

    ``gather()`` runs once per step on every train rank, before any byte moves, in the same order on
    all of them (it may be a collective over the trainer's ranks, e.g. DTensor ``full_tensor()``);
    it returns the :class:`LoraFactors` of every adapted module by module name."""

    def gather(self) -> Mapping[str, LoraFactors]: ...


class AdapterReceiver(ABC):
    """What a gen rank receives into in adapter mode, in place of an engine's model (engine plugins build theirs
    on :class:`refit_core.kit.AdapterSlots`). The core's own hooks hand the receiver its destination map and call
    :meth:`begin`, :meth:`finish` and :meth:`abort` around each step, so an engine plugin's hooks answer None
    for it."""

    @abstractmethod
    def destination_map(self) -> DestinationMap:
        """Where the adapter's boxes land in the engine's slots."""

    @abstractmethod
    def begin(self) -> None:
        """Before any byte of a step lands (it may raise to refuse the step)."""

    @abstractmethod
    def finish(self, version: int) -> None:
        """Every byte of ``version`` landed."""

    @abstractmethod
    def abort(self) -> None:
        """The step failed: the previous version serves again."""


@dataclass(frozen=True)
class LoraMerge:
    """What a merged-mode source piece adds to its box of a base weight: ``scale * B @ A`` over the
    box's rows and columns, with PEFT's arithmetic (:mod:`refit_core.run.merge`)."""

    module: str
    """The HF module whose base weight the piece holds (``model.layers.0.self_attn.q_proj``)."""
    scale: float
    factors: AdapterFactors = field(compare=False, repr=False)
    """The provider of this module's adapter; one object for every piece of a model."""


@dataclass
class MergedSourcePiece(SourcePiece):
    """A source piece of a base weight adapted by LoRA (merged mode): its ``view`` holds the base
    weight ``W``; the sender sends ``W + scale * B @ A`` for its box, computed in the pack step."""

    merge: LoraMerge | None = field(default=None, repr=False, compare=False)
    """None: nothing to add (the piece is sent as it is)."""
