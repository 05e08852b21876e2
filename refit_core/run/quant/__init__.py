"""Quantization kernels that run every step (what they compute: :class:`~refit_core.contract.spec.Quantization`).

- :mod:`.reference`: a plain-torch reference quantizer, block by block (the tests' ground truth);
- :mod:`.fast`: the per-tensor quantizer (vectorized; ``torch.compile`` on CUDA, eager elsewhere);
- :mod:`.boxes`: the boxes a pack step quantizes and the batch interface (a leaf);
- :mod:`.batched`: every quantized segment of a round in one batch (:mod:`.triton_blocks` on CUDA);
- :mod:`.receiver`: receiver-side quantization after the high-precision bytes landed.

Where quantization happens (sender or receiver) is a planning decision: :mod:`refit_core.plan.quant_rules`.
"""
