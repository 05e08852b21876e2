"""refit-plugin-verl: refit as a verl checkpoint engine.

``refit_verl.engine`` registers the ``refit`` backend in verl's ``CheckpointEngineRegistry`` (set it as
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module``); it needs verl. ``plugin`` is the
refit backend ``verl`` (entry point ``refit: verl``): verl's FSDP2 and Megatron training engines as refit
sources, their shards read in place (``megatron``: through refit-plugin-megatron). ``sources`` finds the
actor's model and the rollout's destination in verl's workers; ``conformance`` is the backend's suite. Only
``engine`` imports verl.
"""

from .sources import is_training_engine, source_model

BACKEND = "refit"
"""The checkpoint-engine backend name in verl's registry (``checkpoint_engine.backend``)."""

__all__ = ["BACKEND", "is_training_engine", "source_model"]
