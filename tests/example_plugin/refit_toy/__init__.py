"""An example third-party refit backend plugin, the one docs/writing-a-plugin.md walks through.

Two toy "frameworks": :class:`~refit_toy.models.ToyTrainer` shards a small transformer-like state
by rows (experts by expert index, norms replicated); :class:`~refit_toy.models.ToyEngine` holds it
the way an inference engine would (column shards, a fused QKV replicated everywhere, stacked
experts sharded on the expert dim, bf16 embeddings).

It also ships an example transport, ``toy-tcp`` (:mod:`refit_toy.tcp`: plain TCP sockets, CPU tensors), the
one docs/writing-a-transport.md walks through.
"""
