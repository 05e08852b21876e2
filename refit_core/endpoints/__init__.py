"""The two endpoints of a refit: :class:`RefitSender` (every train rank) and :class:`RefitReceiver` (every gen rank).

- :mod:`.base`: what both share: rendezvous, setup, binding, teardown;
- :mod:`.agreement`: the setup protocol's steps: metadata exchange, planning on train rank 0, each rank's
  part of the plan, link assignment, the fingerprint barrier;
- :mod:`.commit`: the commit point of every step: the gen ranks vote, train rank 0 decides, every rank reads it;
- :mod:`.sender`, :mod:`.receiver`: the two sides.

Both are public from :mod:`refit_core`.
"""

from refit_core.endpoints.receiver import RefitReceiver, StepStats
from refit_core.endpoints.sender import RefitSender

__all__ = ["RefitReceiver", "RefitSender", "StepStats"]
