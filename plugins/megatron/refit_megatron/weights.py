"""Set a megatron model's weights from a HF state dict, in place (demo and benchmark)."""

from __future__ import annotations

import torch

from refit_core.apps import reference_region

from .source import MegatronSource, live_pieces


@torch.no_grad()
def load_hf_weights(source: MegatronSource, state_dict: dict[str, torch.Tensor]) -> int:
    """Write every source piece's box of ``state_dict`` into the model; returns elements written.

    This reuses the plugin's own mapping, so it is no independent check of it: the tests set
    weights by megatron's own initialisation and convert them back with their own routine.
    """
    written = 0
    for piece in live_pieces(source):
        assert piece.view is not None  # live pieces always carry their view
        piece.view.copy_(reference_region(piece, state_dict))
        written += piece.box.numel
    return written
