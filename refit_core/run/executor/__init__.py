"""The executor: runs this rank's part of the schedule every step.

Per round, the sender packs the segments of its *staged* messages (casting to the wire dtype) into a
contiguous staging buffer with one batched copy, then posts the round's sends as one grouped
exchange; the receiver posts its receives, then unpacks its staged messages with one batched copy.
A message whose segments are one contiguous, gap-free run of this side's memory in the same dtype
(a whole parameter, the ``[Q; K; V]`` rows of a fused QKV, ``[gate_e; up_e]`` of stacked experts) is
*direct*: sent straight from the weights or received straight into them, with no staging copy. Each
side decides that for itself at ``bind()``: the bytes on the wire are the same either way.

With ``num_buffers`` staging buffers the packing of round k+1 overlaps the transfer of round k and
the unpacking of round k-1 on CUDA (copies on a side stream, the transport on its own stream,
ordered by events only; a buffer is reused only after the event of its last use). Staging memory
never exceeds ``num_buffers x bucket_bytes``; each buffer is allocated when a step's staged rounds first
need it (not before the first byte moves) and released at the step's end. Refit's streams first wait for
the work already queued on the caller's current stream.

An executor takes everything through its constructor (:class:`ExecutorSettings`, the
:class:`HeaderScope` its headers claim, the :class:`StepCount` it shares) or through ``run()`` (the
step's version, adapters, failure bookkeeping and timeline); nothing is set on it from outside.

- :mod:`.rounds`: a round resolved onto local memory (direct or staged) and its staging buffers;
- :mod:`.headers`: the step header that proves both ends run the same plan, step and subset;
- :mod:`.base`: what both directions share; :mod:`.send`, :mod:`.receive`: the two directions.
"""

from refit_core.run.executor.base import ExecutorSettings, RoundRunner, StepCount, StepStats
from refit_core.run.executor.headers import (
    HEADER_WORDS,
    MAGIC,
    WHOLE_PLAN,
    HeaderScope,
    SubsetMismatchError,
    SubsetTag,
)
from refit_core.run.executor.receive import ForwardExecutor, ReceiveExecutor
from refit_core.run.executor.rounds import Post, RoundPlan, StagedSegment, direct_region
from refit_core.run.executor.send import Merging, SendExecutor

__all__ = ["HEADER_WORDS", "MAGIC", "WHOLE_PLAN", "ExecutorSettings", "ForwardExecutor", "HeaderScope", "Merging",
           "Post", "ReceiveExecutor", "RoundPlan", "RoundRunner", "SendExecutor", "StagedSegment", "StepCount",
           "StepStats", "SubsetMismatchError", "SubsetTag", "direct_region"]
