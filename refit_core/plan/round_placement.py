"""Placing messages in rounds: at most ``bucket_bytes`` per rank and direction in each round, paced.

A *round* is a set of messages that run at once as one grouped point-to-point exchange; every rank walks
its rounds in increasing order, so rounds never wait on each other in a cycle.
"""

from __future__ import annotations

from collections import defaultdict, deque

from refit_core.plan.items import Message, align


def place_in_rounds(per_pair: dict[tuple[int, int], list[Message]], bucket_bytes: int) -> list[list[Message]]:
    """Messages into rounds of at most ``bucket_bytes`` per rank and direction, paced.

    The busiest rank needs ``T = ceil(its bytes / bucket_bytes)`` rounds at least; if every pair moved
    ``1 / T`` of its bytes per round, no rank would exceed the bucket and the step would take those
    ``T`` rounds. So each round is filled in two stages, each in passes over the pairs (the pairs whose
    two ends have the most bytes left first; a pair takes its next message per pass while both ends
    have room): first every pair up to its even share of ``(r + 1) / T`` of its bytes, then any pair
    into the room left. Pacing keeps every pair of a busy rank moving in every round, so the ranks
    that bound the step (the busiest sender, a gen rank receiving from many train ranks) stay full to
    their last round; the fill keeps rounds full where messages are too coarse to pace exactly.
    A pair's messages keep their order.
    """
    queues = {pair: deque(msgs) for pair, msgs in sorted(per_pair.items()) if msgs}
    pair_bytes = {pair: sum(align(m.nbytes) for m in msgs) for pair, msgs in queues.items()}
    to_send: dict[int, int] = defaultdict(int)  # bytes each rank has left (messages sit 16-byte aligned)
    to_receive: dict[int, int] = defaultdict(int)
    for (src, dst), nbytes in pair_bytes.items():
        to_send[src] += nbytes
        to_receive[dst] += nbytes
    fewest_rounds = -(-max([*to_send.values(), *to_receive.values(), 0]) // bucket_bytes)
    moved: dict[tuple[int, int], int] = defaultdict(int)
    rounds: list[list[Message]] = []
    while queues:
        share = min(1.0, (len(rounds) + 1) / fewest_rounds)
        sent: dict[int, int] = defaultdict(int)
        received: dict[int, int] = defaultdict(int)
        placed: list[Message] = []
        for paced in (True, False):
            active = sorted(queues, key=lambda p: (-(to_send[p[0]] + to_receive[p[1]]), p))
            while active:  # passes: each pair places one message per pass while both ends have room
                still = []
                for pair in active:
                    queue = queues[pair]
                    src, dst = pair
                    size = align(queue[0].nbytes)
                    if sent[src] + size > bucket_bytes or received[dst] + size > bucket_bytes:
                        continue  # loads only grow within a round: this pair is done for the stage
                    if paced and moved[pair] + size > pair_bytes[pair] * share:
                        continue  # its share of this round is placed
                    placed.append(queue.popleft())
                    sent[src] += size
                    received[dst] += size
                    to_send[src] -= size
                    to_receive[dst] -= size
                    moved[pair] += size
                    if queue:
                        still.append(pair)
                    else:
                        del queues[pair]
                active = still
        if not placed:
            raise ValueError(f"a message is larger than the bucket ({bucket_bytes} bytes)")
        rounds.append(placed)
    return rounds
