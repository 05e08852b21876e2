"""Which link moves the bytes of one (train rank, gen rank) pair: the per-pair policy, at setup.

Every rank publishes its :class:`Placement` at setup; every rank then applies :func:`choose_link`
to every pair of the plan with the :class:`Colocation` setting of train rank 0, so all ranks agree
on every pair's link without another word. One step may mix links: a colocated TP=2 trainer and
TP=2 engine on two GPUs move their same-GPU pairs through CUDA IPC and the other pairs through NCCL.
"""

from __future__ import annotations

import enum
import functools
import socket
from dataclasses import dataclass

import torch

from refit_core.contract.errors import PlanError
from refit_core.contract.options import Colocation


class Link(enum.Enum):
    """How one pair's bytes move."""

    NETWORK = "network"
    """The refit's network transport (NCCL on CUDA, gloo on CPU): packed messages."""
    SHARED_MEMORY = "shared-memory"
    """Same host, CPU: the receiver copies straight out of the trainer's shared-memory parameters."""
    CUDA_IPC = "cuda-ipc"
    """Same GPU: the receiver copies straight out of the trainer's parameters through CUDA IPC."""

@dataclass(frozen=True)
class Placement:
    """Where a rank's pieces live: its host and its device (``cpu`` or ``cuda:<uuid>``)."""

    host: str
    device: str

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def encode(self) -> str:
        return f"{self.host}|{self.device}"

    @classmethod
    def decode(cls, text: str) -> Placement:
        host, _, device = text.rpartition("|")
        return cls(host, device)


@functools.cache
def this_host() -> str:
    """This machine's identity: hostname and boot id (containers on one kernel share memory)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def placement_of(device: torch.device, host: str | None = None) -> Placement:
    """The placement of a rank whose pieces live on ``device`` (``host`` overrides this machine's
    identity: ranks with different ``host`` strings never share memory, e.g. in tests)."""
    if device.type == "cuda":
        ident = f"cuda:{torch.cuda.get_device_properties(device).uuid}"
    else:
        ident = device.type
    return Placement(host or this_host(), ident)


def choose_link(src: Placement, dst: Placement, colocation: Colocation) -> Link:
    """The link for a train rank at ``src`` sending to a gen rank at ``dst``.

    Raises :class:`PlanError` for a same-GPU pair under ``Colocation.OFF`` (no transport can move it).
    """
    same_gpu = src.on_gpu and src == dst
    if same_gpu:
        if colocation is Colocation.OFF:
            raise PlanError("a transfer would connect two ranks on the same GPU and colocation is 'off': "
                            "NCCL cannot do that; use colocate='auto' (CUDA IPC) or place the ranks on "
                            "different GPUs")
        return Link.CUDA_IPC
    if (colocation is Colocation.SHARED and src.host == dst.host
            and not src.on_gpu and not dst.on_gpu and src.device == dst.device):
        return Link.SHARED_MEMORY
    return Link.NETWORK


def pair_links(pairs: set[tuple[int, int]], train: list[Placement], gen: list[Placement],
               colocation: Colocation) -> dict[tuple[int, int], Link]:
    """The link of every ``(train rank, gen rank)`` pair of a plan; same-GPU refusals name the ranks."""
    links = {}
    refused = []
    for src, dst in sorted(pairs):
        try:
            links[(src, dst)] = choose_link(train[src], gen[dst], colocation)
        except PlanError:
            refused.append((src, dst))
    if refused:
        named = ", ".join(f"train {s} -> gen {d}" for s, d in refused[:5])
        raise PlanError(f"{len(refused)} transfer(s) would connect two ranks on the same GPU ({named}) "
                        "and colocation is 'off': NCCL cannot do that; use colocate='auto' (CUDA IPC) "
                        "or place the train and gen ranks that exchange weights on different GPUs")
    return links


__all__ = ["Colocation", "Link", "Placement", "choose_link", "pair_links", "placement_of", "this_host"]
