"""``refit demo`` on the GPUs present: layouts that fit, or a refusal before anything starts.

Each side of the demo is its own program with its own process group (the trainer's NCCL group, the
engine's tensor-parallel group), and NCCL refuses two ranks of one group on one GPU ("Duplicate GPU
detected"): a side needs one GPU per rank. Between the sides refit itself copes with shared GPUs
(CUDA IPC for same-GPU pairs), so without ``--colocate`` the sides are kept on different GPUs only
where the GPUs allow it. A layout the user gave is never changed: if it cannot fit, the demo is
refused, naming the layout and the GPU count. A default layout that cannot fit is shrunk to one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from refit_core.contract.errors import RefitError
from refit_core.contract.layout import ParallelLayout


@dataclass(frozen=True)
class SideLayout:
    """One side's layout for the demo. ``given``: True when the user passed it (``--train-layout`` /
    ``--gen-layout``) and it must not be changed; False for the backend's default, which may shrink."""

    side: str
    backend: str
    layout: str
    given: bool

    @property
    def ranks(self) -> int:
        return ParallelLayout.parse(self.layout).world_size

    @property
    def option(self) -> str:
        return f"--{self.side}-layout"

    def describe(self) -> str:
        return f"{self.layout or 'one rank'} ({self.ranks} rank{'s' if self.ranks != 1 else ''})"


@dataclass(frozen=True)
class LayoutFit:
    """The layouts ``refit demo`` runs. ``notes``: one line per default layout that was shrunk to fit
    (empty: the layouts run as asked)."""

    train_layout: str
    gen_layout: str
    notes: tuple[str, ...] = ()


def _gpus(count: int) -> str:
    return f"{count} GPU{'s' if count != 1 else ''}"


def fit_layouts(train: SideLayout, gen: SideLayout, gpus: int, *, colocate: bool) -> LayoutFit:
    """The layouts to run on ``gpus`` GPUs; raises :class:`RefitError` if a given layout cannot fit.

    Every side gets at most one rank per GPU. Without ``colocate`` the two sides are also kept on
    different GPUs when both use their defaults: if together they need more GPUs than present, both
    defaults shrink to one rank (with one GPU the two ranks then share it, through CUDA IPC).
    """
    if gpus < 1:
        raise RefitError("refit demo --device cuda: no CUDA GPU is present (use --device cpu)")
    notes: list[str] = []
    layouts = {}
    for side in (train, gen):
        if side.ranks <= gpus:
            layouts[side.side] = side.layout
            continue
        if side.given:
            raise RefitError(
                f"{side.option} {side.layout} puts {side.ranks} ranks of the {side.backend} {side.side} side's "
                f"process group on {_gpus(gpus)}, and NCCL refuses two ranks of one group on one GPU "
                f"(\"Duplicate GPU detected\"): give a layout of at most {gpus} rank{'s' if gpus != 1 else ''}"
                + ("" if colocate else ", or --colocate to share the GPUs between the sides"))
        notes.append(f"the {side.backend} {side.side} side's default layout {side.describe()} needs "
                     f"{_gpus(side.ranks)} (one per rank), {_gpus(gpus)} present: running it on one rank "
                     f"(pass {side.option} to choose)")
        layouts[side.side] = ""
    fitted = LayoutFit(layouts[train.side], layouts[gen.side], tuple(notes))
    needed = ParallelLayout.parse(fitted.train_layout).world_size + ParallelLayout.parse(fitted.gen_layout).world_size
    if colocate or needed <= gpus or train.given or gen.given:
        return fitted
    shrunk = [s for s in (train, gen) if layouts[s.side]]
    if not shrunk:
        return fitted
    sides = " and ".join(f"{s.backend} {s.side} {s.describe()}" for s in shrunk)
    note = (f"the default layouts need {_gpus(needed)} side by side ({sides}), {_gpus(gpus)} present: "
            "running one rank a side (pass --train-layout / --gen-layout to choose, or --colocate)")
    return LayoutFit("", "", (*notes, note))


__all__ = ["LayoutFit", "SideLayout", "fit_layouts"]
