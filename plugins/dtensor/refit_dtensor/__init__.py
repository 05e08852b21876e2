"""refit-plugin-dtensor: PyTorch DTensor / FSDP2 / tensor-parallel ``transformers`` models as refit
sources and destinations.

Modules: ``names`` (HF checkpoint names of parameters), ``placements`` (DTensor placements ->
boxes), ``shards`` (model -> pieces), ``parallel`` (the standard mesh / TP plan / FSDP2 layout),
``layout`` (metadata-only pieces for ``refit plan``), ``plugin`` (the hooks), ``demo``.
"""

from .names import Naming, clean_name, named_parameters, unwrap
from .parallel import build_model, init_mesh, rank_coordinate, shard_model
from .placements import LocalBlock, local_blocks, tensor_blocks
from .shards import load_hf_weights, model_pieces

__all__ = [
    "LocalBlock", "Naming", "build_model", "clean_name", "init_mesh", "load_hf_weights", "local_blocks",
    "model_pieces",
    "named_parameters", "rank_coordinate", "shard_model", "tensor_blocks", "unwrap",
]
