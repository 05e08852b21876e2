"""Bitwise checks of destination memory against reference HF weights (demo, tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .experts import ungroup_name
from .pieces import Piece
from .spec import Box


def reference_region(piece: Piece, reference: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The reference values of ``piece``'s box, in the piece's dtype.

    ``reference`` holds checkpoint tensors; a grouped expert name missing from it is stacked from
    its per-expert entries (only the experts the box covers).
    """
    name, box = piece.spec.name, piece.box
    if name in reference:
        return box.slice_of(reference[name]).to(piece.spec.dtype)
    first, count = box.offsets[0], box.sizes[0]
    stacked = torch.stack([reference[ungroup_name(name, e)] for e in range(first, first + count)])
    return Box((0, *box.offsets[1:]), box.sizes).slice_of(stacked).to(piece.spec.dtype)


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
