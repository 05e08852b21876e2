"""Rank programs for the settings-agreement tests: one train rank, one gen rank, toy models."""

from __future__ import annotations

import os

from refit_toy.demo import reference
from refit_toy.models import ToyEngine, ToyTrainer

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.kit.verify import mismatches


def mismatched_setups(rank: int, world: int, cases: list[tuple[str, dict, dict, dict]]) -> list[tuple[str, str, str]]:
    """For every ``(address, train options, gen options, gen environment)``: set up, expect a failure.

    Returns ``(address, error type, message)`` per case, in order.
    """
    out = []
    for address, train_options, gen_options, gen_env in cases:
        saved = {k: os.environ.get(k) for k in gen_env}
        try:
            if rank == 0:
                endpoint = RefitSender(ToyTrainer(0, 1), rendezvous=address, rank=0, world_size=1,
                                       options=RefitOptions(**train_options))
            else:
                os.environ.update(gen_env)
                endpoint = RefitReceiver(ToyEngine(0, 1), rendezvous=address, rank=0, world_size=1,
                                         options=RefitOptions(**gen_options))
            endpoint.setup()
            endpoint.close()
            out.append((address, "none", "setup succeeded"))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out.append((address, type(exc).__name__, str(exc)))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return out


def adopted_settings(rank: int, world: int, address: str, train_options: dict, gen_timeout_s: float) -> dict:
    """Gen sets nothing but its own ``gen_timeout_s``: it adopts the train side's other settings and refits
    bitwise."""
    if rank == 0:
        sender = RefitSender(ToyTrainer(0, 1), rendezvous=address, rank=0, world_size=1,
                             options=RefitOptions(**train_options))
        sender.setup()
        model = sender.model
        model.load(reference(0, 0))
        sender.send(version=7)
        settings = sender.settings
        fingerprint = sender.schedule.fingerprint
        sender.close()
        return {"settings": settings.to_wire(), "fingerprint": fingerprint}
    engine = ToyEngine(0, 1)
    receiver = RefitReceiver(engine, rendezvous=address, rank=0, world_size=1,
                             options=RefitOptions(timeout_s=gen_timeout_s))
    receiver.setup()
    stats = receiver.receive()
    pieces = receiver.plugins.destination_map(engine).pieces
    result = {"settings": receiver.settings.to_wire(), "fingerprint": receiver.schedule.fingerprint,
              "version": stats.version, "mismatches": mismatches(pieces, reference(0, 0)),
              "staging": stats.staging_bytes, "direct": stats.direct_bytes}
    receiver.close()
    return result
