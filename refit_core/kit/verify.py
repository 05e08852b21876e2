"""Bitwise checks of destination memory against reference HF weights (demo, tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.experts import ExpertNaming
from refit_core.contract.pieces import Piece
from refit_core.contract.spec import Box, TensorSpec
from refit_core.run.quant.reference import reference_quantize

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element width: what a tensor's bytes are compared as."""


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as integers (one per element where a same-width integer dtype exists, else
    one per byte), from a contiguous copy where it is strided."""
    tensor = tensor.detach().contiguous()
    word = _WORDS.get(tensor.element_size())
    if word is not None and not tensor.is_complex():
        return tensor.view(word)
    return tensor.reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if ``a`` and ``b`` have the same dtype and shape and every element has the same bytes
    (-0.0 differs from 0.0, a NaN equals only a NaN with the same payload); False otherwise.

    Strided tensors compare by their elements, not their storage; ``b`` is copied to ``a``'s device if
    it is elsewhere. This is what "bitwise" means in refit: ``torch.equal`` calls -0.0 equal to 0.0
    and a NaN unequal to itself.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_words(a), _words(b.to(a.device)))


def reference_region(piece: Piece, reference: Mapping[str, torch.Tensor],
                     naming: ExpertNaming | None = None) -> torch.Tensor:
    """The reference values of ``piece``'s box, in the piece's dtype.

    ``reference`` holds checkpoint tensors; a grouped expert name missing from it is stacked from
    its per-expert entries (only the experts the box covers), named through ``naming`` (default:
    the installed plugins' expert naming hooks).
    """
    name, box = piece.spec.name, piece.box
    if name in reference:
        return box.slice_of(reference[name]).to(piece.spec.dtype)
    if naming is None:
        from refit_core.contract.plugins import get_plugin_manager

        naming = get_plugin_manager().expert_naming()
    first, count = box.offsets[0], box.sizes[0]
    if count == 0:  # a rank holding none of a group's experts: nothing to compare
        return torch.empty(box.sizes, dtype=piece.spec.dtype)
    experts = []
    for e in range(first, first + count):
        member = naming.member_name(name, e)
        if member is None or member not in reference:
            raise RefitError(f"the reference has no tensor {name} nor its expert {e} "
                             f"({member or 'no per-expert name'})")
        experts.append(reference[member])
    stacked = torch.stack(experts)
    return Box((0, *box.offsets[1:]), box.sizes).slice_of(stacked).to(piece.spec.dtype)


def quantized_reference(reference: Mapping[str, torch.Tensor], pieces: Sequence[Piece]
                        ) -> dict[str, torch.Tensor]:
    """``reference`` plus, for every quantized tensor among ``pieces``, its values and scales as the
    reference quantizer (:func:`refit_core.run.quant.reference.reference_quantize`) makes them from the
    high-precision reference (grouped experts are stacked first)."""
    out = dict(reference)
    specs = {p.spec.name: p.spec for p in pieces if p.spec.quant is not None}
    for name, spec in specs.items():
        quant = spec.quant
        assert quant is not None
        full = Piece(TensorSpec(name, spec.shape, torch.float32), Box.full(spec.shape))
        values, scales = reference_quantize(reference_region(full, reference), quant)
        out[name], out[quant.scale_name] = values, scales
    return out


def mismatches(pieces: Sequence[Piece], reference: Mapping[str, torch.Tensor],
               naming: ExpertNaming | None = None) -> list[str]:
    """Names and boxes of every piece whose view differs from the reference, bit for bit (see
    :func:`same_bytes`)."""
    bad = []
    for piece in pieces:
        if piece.view is None:
            continue
        if not same_bytes(reference_region(piece, reference, naming), piece.view):
            bad.append(f"{piece.spec.name}{piece.box}")
    return bad
