"""Replicas that come and go: a fleet of engine replicas that join, die and restart while the trainers refit.

The trainers (one :class:`~refit_core.fleet.trainer.RefitFleet` per train rank) and the fleet's store (train
rank 0 hosts it) live for the whole run. A replica joins between two steps (:func:`~refit_core.fleet.replica.
join_fleet`, every rank of the replica) and receives the next step whole; one that dies, leaves or fails a
step is dropped from the next step's fanout and may join again, under its name or another. Each replica is
refit over a job of its own with the trainers, so a step is judged per replica: a replica lost mid-step fails
that step for itself alone, and the others commit it as usual.
"""
