"""refit-plugin-sglang: refit straight into SGLang's fused parameters.

- :mod:`refit_sglang.plugin`: refit's hooks (destination map, update lifecycle, metadata-only layout);
- :mod:`refit_sglang.worker`: the custom weight loader SGLang's TP workers run inside
  ``update_weights_from_tensor`` (one refit step per call);
- :mod:`refit_sglang.client`: the trainer's calls for an offline ``Engine`` and for the HTTP server.

Importing this package does not import SGLang.
"""

from .state import attach

__all__ = ["attach"]
