"""LoRA in planning: adapter pieces derived from base-weight pieces (``refit plan --lora``), and the
checks an adapter refit makes before anything moves.

Metadata alone has no adapter, so :func:`adapter_metas` derives one per adapted base weight: ``A``
``[rank, in]`` and ``B`` ``[out, rank]``, sharded like the weight they adapt (a box of rows of ``W``
gives those rows of ``B`` and the whole of ``A``; a box of columns gives those columns of ``A`` and
the whole of ``B``). That is how tensor-parallel engines hold them (column-parallel ``B``,
row-parallel ``A``); a trainer that shards them otherwise moves the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from refit_core.contract.errors import PlanError
from refit_core.contract.lora import LoraSpec, adapter_tensor_names
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, TensorSpec

_WEIGHT = ".weight"


def adapted_module(name: str, spec: LoraSpec) -> str | None:
    """The HF module whose base weight tensor ``name`` is, if ``spec`` adapts it; else None."""
    if not name.endswith(_WEIGHT):
        return None
    module = name[: -len(_WEIGHT)]
    return module if spec.targets_module(module) else None


def adapter_metas(ranks: Sequence[Sequence[PieceMeta]], spec: LoraSpec) -> list[list[PieceMeta]]:
    """Every rank's adapter pieces for ``spec``, derived from its base-weight pieces (see the module
    docstring); a :class:`PlanError` naming the targets no module has, and adapted weights that are not
    matrices (fused MoE experts)."""
    out: list[list[PieceMeta]] = []
    seen: set[str] = set()
    for metas in ranks:
        mine: dict[tuple[str, Box], PieceMeta] = {}
        for meta in metas:
            module = adapted_module(meta.spec.name, spec)
            if module is None:
                continue
            if len(meta.spec.shape) != 2:
                raise PlanError(f"{module}: LoRA target {module.rsplit('.', 1)[-1]!r} holds a "
                                f"{len(meta.spec.shape)}-D weight {list(meta.spec.shape)} (fused experts?): "
                                "refit adapts 2-D linear weights only")
            seen.add(module.rsplit(".", 1)[-1])
            out_features, in_features = meta.spec.shape
            a_name, b_name = adapter_tensor_names(module)
            a = TensorSpec(a_name, (spec.rank, in_features), meta.spec.dtype)
            b = TensorSpec(b_name, (out_features, spec.rank), meta.spec.dtype)
            (row, col), (rows, cols) = meta.box.offsets, meta.box.sizes
            for piece in (PieceMeta(a, Box((0, col), (spec.rank, cols))),
                          PieceMeta(b, Box((row, 0), (rows, spec.rank)))):
                mine.setdefault((piece.spec.name, piece.box), piece)
        out.append(list(mine.values()))
    missing = [t for t in spec.targets if t not in seen]
    if missing:
        raise PlanError(f"LoRA targets {missing} name no 2-D weight of the model (its 2-D weights are on "
                        f"{sorted(_leaves(ranks))})")
    return out


def _leaves(ranks: Sequence[Sequence[PieceMeta]]) -> set[str]:
    return {m.spec.name[: -len(_WEIGHT)].rsplit(".", 1)[-1] for metas in ranks for m in metas
            if m.spec.name.endswith(_WEIGHT) and len(m.spec.shape) == 2}


__all__ = ["adapted_module", "adapter_metas"]
