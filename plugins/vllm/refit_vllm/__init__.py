"""refit-plugin-vllm: refit straight into a running vLLM engine.

- :mod:`refit_vllm.plugin`: refit's hooks (destination map, update lifecycle, metadata-only layout);
- :mod:`refit_vllm.transfer`: the ``refit`` vLLM weight-transfer backend, worker and trainer sides;
- :mod:`refit_vllm.extension`: a worker extension class for ``collective_rpc`` users;
- :mod:`refit_vllm.clients`: trainer-side clients for an in-process ``LLM`` / ``AsyncLLM``;
- :mod:`refit_vllm.lora`: adapter mode, a LoRA adapter straight into the engine's LoRA slots
  (:mod:`refit_vllm.lora_layout`: its metadata-only boxes).

Importing this package does not import vLLM.
"""

from .state import attach

__all__ = ["attach"]
