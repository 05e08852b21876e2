"""Quantized destinations: FP8 (block / per-channel / per-tensor) weights with their scale tensors.

- :mod:`.spec`: :class:`Quantization`, what a destination tensor says it holds;
- :mod:`.reference`: a plain-torch reference quantizer, block by block (the tests' ground truth);
- :mod:`.fast`: the quantizer refit runs (vectorized; ``torch.compile`` on CUDA, eager elsewhere);
- :mod:`.rules`: the per-tensor dtype decisions and where quantization happens (sender or receiver);
- :mod:`.receiver`: receiver-side quantization after the high-precision bytes landed.
"""

from .spec import BLOCK_SCALE_SUFFIX, FP8_DTYPES, QuantScheme, Quantization, QuantSite, QuantizeStep

__all__ = ["BLOCK_SCALE_SUFFIX", "FP8_DTYPES", "QuantScheme", "QuantSite", "Quantization", "QuantizeStep"]
