"""Bitwise checks of destination memory against reference HF weights (demo, tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .experts import ungroup_name
from .pieces import Piece


def reference_region(piece: Piece, reference: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The reference values of ``piece``'s box, in the piece's dtype.

    ``reference`` holds checkpoint tensors; a grouped expert name missing from it is stacked from
    its per-expert entries.
    """
    name = piece.spec.name
    if name in reference:
        full = reference[name]
    else:
        first, count = piece.box.offsets[0], piece.box.sizes[0]
        rows = [reference[ungroup_name(name, e)] for e in range(first, first + count)]
        full = torch.stack(rows)
        return _cut(full, piece, skip_first=True)
    return _cut(full, piece, skip_first=False)


def _cut(full: torch.Tensor, piece: Piece, *, skip_first: bool) -> torch.Tensor:
    region = full
    for dim, (o, s) in enumerate(zip(piece.box.offsets, piece.box.sizes)):
        if skip_first and dim == 0:
            continue
        region = region.narrow(dim, o, s)
    return region.to(piece.spec.dtype)


def mismatches(pieces: Sequence[Piece], reference: Mapping[str, torch.Tensor]) -> list[str]:
    """Names and boxes of every piece whose view differs from the reference, bit for bit."""
    bad = []
    for piece in pieces:
        if piece.view is None:
            continue
        expected = reference_region(piece, reference)
        if not torch.equal(piece.view.cpu(), expected.cpu()):
            bad.append(f"{piece.spec.name}{piece.box}")
    return bad
