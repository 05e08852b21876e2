"""Planning: pure functions of piece metadata, no model, no network.

Every rank's metadata in (read with the schema of :mod:`.codec`), frozen records out: transfers, messages
and segments (:mod:`.items`), the reference and fast planners (:mod:`.reference`, :mod:`.fast`) and the
steps they share (:mod:`.regions`), messages placed in rounds (:mod:`.schedule`), relay fanout and
forwarding within nodes (:mod:`.relay`), the whole plan a live setup and ``refit plan`` make
(:mod:`.planning`), each rank's own part of the plan (:mod:`.rankplan`), which link a pair uses
(:mod:`.links`), the offline driver behind ``refit plan`` (:mod:`.offline`), the simulator
(:mod:`.simulate`) and the relay choices made by simulation (:mod:`.choose`). Imports only
:mod:`refit_core.contract`. Internal.
"""
