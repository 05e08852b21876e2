"""The plugin against vLLM's weight-transfer API, without an engine: ``python weight_transfer_api.py [DIR]``.

With ``DIR`` (a vLLM 0.33 ``weight_transfer`` package, see ``vllm_releases.py``) that package is
mounted first. Prints ``RESULT {...}`` last. Checks: the plugin imports and registers with both
factories; the worker engine is created by vLLM's factory and parses its init / update infos
(rejecting unknown fields); ``RefitSource`` declares and yields the model's parameters; and a real
refit runs through vLLM's trainer factory: ``trainer_init`` + ``send_weights`` drive a client whose
calls go to a ``RefitReceiver`` in this process, and the destination model ends bitwise equal.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class LocalClient:
    """A ``VLLMWeightSyncClient`` whose engine is a ``RefitReceiver`` on a plain model in this process."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.receiver: Any = None
        self.calls: list[str] = []
        self.versions: list[str | None] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from refit_core import RefitOptions, RefitReceiver

        self.calls.append("init")
        self.receiver = RefitReceiver(self.model, rendezvous=init_info["rendezvous"], rank=0,
                                      world_size=init_info["world_size"] or 1,
                                      options=RefitOptions(**init_info["options"]))
        self.receiver.setup()

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")
        stats = self.receiver.receive()
        if stats.version != update_info["version"]:
            raise AssertionError(f"received version {stats.version}, asked for {update_info['version']}")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        self.versions.append(weight_version)


class WorkerClient:
    """A ``VLLMWeightSyncClient`` whose engine is the plugin's worker-side engine, driven as vLLM's worker
    drives it (``parse_init_info`` then ``init_transfer_engine``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.error: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        try:
            self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            raise


REFUSAL_TIMEOUT_S = 600.0


def refused_init(source: Any, model: Any) -> dict[str, Any]:
    """The engine's second worker (of 2) joins a refit the trainer sized for one gen rank: it refuses
    before its setup; the trainer must fail with the engine's text, not wait for it."""
    import time

    import torch
    from refit_vllm import transfer
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from refit_core.kit.launch import free_port

    parallel = SimpleNamespace(world_size=2, rank=1, data_parallel_index=0, data_parallel_size=1)
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="refit"), SimpleNamespace(parallel_config=parallel, model_config=None),
        torch.device("cpu"), model)
    client = WorkerClient(engine)
    info = transfer.RefitTrainerInitInfo(rank=0, rendezvous=f"127.0.0.1:{free_port()}", world_size=1,
                                         gen_world_size=1, options={"timeout_s": REFUSAL_TIMEOUT_S})
    start = time.perf_counter()
    try:
        WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        trainer_error = None
    except Exception as exc:  # noqa: BLE001 - the expected outcome
        trainer_error = f"{type(exc).__name__}: {exc}"
    return {"seconds": time.perf_counter() - start, "timeout_s": REFUSAL_TIMEOUT_S, "trainer_error": trainer_error,
            "engine_error": client.error}


CLIENT_TIMEOUT_S = 600.0
NOT_CONFIGURED = "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
"""What vLLM's worker raises for ``init_weight_transfer_engine`` on an engine started without
``weight_transfer_config`` (``Worker._check_weight_transfer_engine``, ``vllm/v1/worker/gpu_worker.py``)."""


class UnconfiguredEngine:
    """A client whose engine was started without ``weight_transfer_config``: its init call raises vLLM's
    error before any refit code runs in the engine (so no gen rank ever joins the refit)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        raise RuntimeError(NOT_CONFIGURED)


def client_refused(config: dict[str, Any]) -> dict[str, Any]:
    """Train rank 0's client call raises, at ``timeout_s=600``: with two train ranks (module sources, on
    threads) and an engine without ``weight_transfer_config``; with one and vLLM's own HTTP client at a
    port where nobody listens. Each rank's error, its cause's type and its seconds: every rank must fail
    at once, with the engine's (the client's) error (it used to take 2 x timeout_s and raise a timeout)."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from refit_core.kit.launch import free_port

    return {"timeout_s": CLIENT_TIMEOUT_S,
            "unconfigured": _trainers_fail(config, [UnconfiguredEngine(), NoCalls()]),
            "http": _trainers_fail(config, [HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{free_port()}")])}


def _trainers_fail(config: dict[str, Any], clients: list[Any]) -> dict[str, Any]:
    """``trainer_init`` on one train rank per client (threads), at ``timeout_s=600``: each rank's error, its
    cause's type and its seconds, by rank."""
    import threading
    import time

    import torch
    from refit_dtensor import build_model
    from refit_vllm import transfer
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from refit_core.kit.launch import free_port

    rendezvous = f"127.0.0.1:{free_port()}"
    sources = [transfer.RefitSource(build_model(config, dtype=torch.float32, seed=10 + r)) for r in range(len(clients))]
    out: dict[str, Any] = {}

    def rank(r: int) -> None:
        info = transfer.RefitTrainerInitInfo(rank=r, rendezvous=rendezvous, world_size=len(clients),
                                             options={"timeout_s": CLIENT_TIMEOUT_S})
        start = time.perf_counter()
        try:
            WeightTransferTrainerFactory.trainer_init(info, client=clients[r], source=sources[r])
            error, cause = None, None
        except Exception as exc:  # noqa: BLE001 - the expected outcome
            error, cause = f"{type(exc).__name__}: {exc}", type(exc.__cause__).__name__
        out[str(r)] = {"error": error, "cause": cause, "seconds": time.perf_counter() - start}

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)  # far below the timeout: a rank still waiting here is the failure this checks
    return out


UPDATE_ERROR = "RuntimeError: 500 Internal Server Error from the engine's /update_weights"


class RefusingUpdate(LocalClient):
    """A client whose engine took ``init`` but whose ``update_weights`` call raises before the engine receives
    (an HTTP error, an engine that refuses the step): its gen rank never enters the step."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")
        raise RuntimeError(UPDATE_ERROR.removeprefix("RuntimeError: "))


def update_refused(config: dict[str, Any]) -> dict[str, Any]:
    """Two train ranks (threads) and one engine rank, at ``timeout_s=600``: train rank 0's ``update_weights``
    call raises. Each train rank's error and seconds from the start of ``send_weights``: every rank must fail
    at once, naming the engine's error (it used to wait ``timeout_s``, then raise a timeout)."""
    import threading
    import time

    import torch
    from refit_dtensor import build_model
    from refit_vllm import transfer
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from refit_core.kit.launch import free_port

    rendezvous = f"127.0.0.1:{free_port()}"
    sources = [transfer.RefitSource(build_model(config, dtype=torch.float32, seed=20 + r)) for r in range(2)]
    clients: list[Any] = [RefusingUpdate(build_model(config, dtype=torch.float32, seed=30)), NoCalls()]
    trainers: list[Any] = [None, None]
    out: dict[str, Any] = {"timeout_s": CLIENT_TIMEOUT_S}

    def init(r: int) -> None:
        info = transfer.RefitTrainerInitInfo(rank=r, rendezvous=rendezvous, world_size=2,
                                             options={"timeout_s": CLIENT_TIMEOUT_S})
        trainers[r] = WeightTransferTrainerFactory.trainer_init(info, client=clients[r], source=sources[r])

    def send(r: int) -> None:
        start = time.perf_counter()
        try:
            trainers[r].send_weights(version=1)
            error = None
        except Exception as exc:  # noqa: BLE001 - the expected outcome
            error = f"{type(exc).__name__}: {exc}"
        out[str(r)] = {"error": error, "seconds": time.perf_counter() - start}

    for target in (init, send):
        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)  # far below the timeout: a rank still waiting here is the failure this checks
    for trainer in trainers:
        if trainer is not None:
            trainer.shutdown()
    clients[0].receiver.close()
    return out


def _error(call: Any) -> str | None:
    """What ``call`` raised: ``"Type: text"``, prefixed by ``ValueError|`` / ``TypeError|`` where it is one."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        kinds = "".join(f"{k.__name__}|" for k in (ValueError, TypeError) if isinstance(exc, k))
        return f"{kinds}{type(exc).__name__}: {exc}"
    return None


def gathered_source(model: Any) -> Any:
    """A custom vLLM ``WeightSource`` (not a module source): metadata plus full tensors, as after a
    gather onto rank 0; it counts its passes."""
    from refit_vllm import compat
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Gathered(WeightSource):
        def __init__(self) -> None:
            self.passes = 0
            self.reordered = False
            """True: iterate in the reverse of metadata order (which vLLM's nccl trainer refuses)."""

        def _metas(self) -> list[Any]:
            return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]

        metadata = compat.metadata_member(_metas)

        def iter_full(self) -> Any:
            self.passes += 1
            params = list(model.named_parameters())
            for name, param in reversed(params) if self.reordered else params:
                yield name, param.detach().clone()

        def __iter__(self) -> Any:
            return self.iter_full()

    return Gathered()


class NoCalls:
    """A client that must not be called (a non-sender rank's)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a non-sender rank called the client's {name}")


def fidelity(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's API behaviours: NCCL-style update info, ValueError where vLLM raises one, any WeightSource
    (a one-rank source), non-sender ranks, a mocked config, a wrong world_size."""
    from unittest.mock import MagicMock

    import torch
    from refit_dtensor import build_model
    from refit_vllm import transfer
    from vllm.config.parallel import ParallelConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from refit_core.apps import same_bytes
    from refit_core.kit.launch import free_port

    out: dict[str, Any] = {}
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="refit"), SimpleNamespace(parallel_config=ParallelConfig(), model_config=None),
        torch.device("cpu"), build_model(config, dtype=torch.float32, seed=1))
    info = engine.parse_update_info({"names": ["w1", "w2"], "dtype_names": ["float32", "bfloat16"],
                                     "shapes": [[100, 100], [50]]})
    out["nccl_update_info"] = [info.names, info.dtype_names, info.shapes, [str(t.dtype) for t in info.tensors]]
    out["short_dtype_names"] = _error(lambda: engine.parse_update_info(
        {"names": ["w1", "w2"], "dtype_names": ["float32"], "shapes": [[1], [2]]}))
    out["bad_dtype_name"] = _error(lambda: engine.parse_update_info(
        {"names": ["w1"], "dtype_names": ["float33"], "shapes": [[1]]}))
    out["no_source"] = _error(lambda: WeightTransferTrainerFactory.trainer_init(
        transfer.RefitTrainerInitInfo(rank=0, rendezvous="127.0.0.1:1"), client=NoCalls()))

    mocked = MagicMock()
    mocked.parallel_config = MagicMock(spec=ParallelConfig, rank=0, world_size=1, data_parallel_rank=0)
    out["mocked_parallel_config"] = _error(lambda: WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="refit"), mocked, torch.device("cpu"), MagicMock(spec=torch.nn.Module)
    ).init_transfer_engine(transfer.RefitWeightTransferInitInfo(rendezvous="")))
    mocked.parallel_config = ParallelConfig()
    out["mocked_model_config"] = _error(lambda: WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="refit"), mocked, torch.device("cpu"), build_model(config, dtype=torch.float32)
    ).init_transfer_engine(transfer.RefitWeightTransferInitInfo(rendezvous="")))

    # any WeightSource: a one-rank source, planned from its metadata; a non-sender rank returns at once
    source_model = build_model(config, dtype=torch.float32, seed=4)
    source = gathered_source(source_model)
    rendezvous = f"127.0.0.1:{free_port()}"
    other = WeightTransferTrainerFactory.trainer_init(
        transfer.RefitTrainerInitInfo(rank=1, rendezvous=rendezvous, world_size=2), client=NoCalls(), source=source)
    out["non_sender"] = [other.kind.name, other.sender is None, other.send_weights(version=5), source.passes]
    target = build_model(config, dtype=torch.float32, seed=5)
    client = LocalClient(target)
    trainer = WeightTransferTrainerFactory.trainer_init(
        transfer.RefitTrainerInitInfo(rank=0, rendezvous=rendezvous, world_size=2, options={"timeout_s": 60}),
        client=client, source=source)
    with torch.no_grad():
        for p in source_model.parameters():
            p.mul_(2.0)
    version = trainer.send_weights(version=5)
    passes = source.passes
    source.reordered = True  # vLLM's nccl trainer raises ValueError (NCCLTrainerWeightTransferEngine._checked_iter)
    out["reordered_source"] = _error(lambda: trainer.send_weights(version=6))
    trainer.shutdown()
    client.receiver.close()
    got = dict(target.named_parameters())
    out["one_rank_source"] = {
        "kind": trainer.kind.name, "version": version, "calls": client.calls, "passes": passes,
        "bitwise_equal": all(same_bytes(got[n], p) for n, p in source_model.named_parameters())}

    # vLLM's nccl world_size counts the trainer and the workers: 2 here, with one train rank
    import time

    start = time.perf_counter()
    out["wrong_world_size"] = _error(lambda: WeightTransferTrainerFactory.trainer_init(
        transfer.RefitTrainerInitInfo(rank=0, rendezvous=f"127.0.0.1:{free_port()}", world_size=2,
                                      options={"timeout_s": WORLD_TIMEOUT_S}),
        client=LocalClient(build_model(config, dtype=torch.float32, seed=6)),
        source=transfer.RefitSource(build_model(config, dtype=torch.float32, seed=7))))
    out["wrong_world_size_s"] = time.perf_counter() - start
    return out


WORLD_TIMEOUT_S = 1.0


def check() -> dict[str, Any]:
    import torch
    from refit_dtensor import build_model
    from refit_vllm import compat, transfer
    from vllm.config.parallel import ParallelConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import base
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from refit_core.apps import same_bytes
    from refit_core.kit.launch import free_port
    from refit_core.kit.models import PRESETS

    result: dict[str, Any] = {"api": compat.SOURCE_API.name, "has_placements": hasattr(base, "Shard"),
                              "weight_transfer_file": base.__file__}
    result["registered"] = [
        WeightTransferEngineFactory._registry["refit"]() is transfer.RefitWeightTransferEngine,
        WeightTransferTrainerFactory._registry["refit"]() is transfer.RefitTrainerWeightTransferEngine,
    ]

    config = PRESETS["tiny-llama"]
    source_model = build_model(config, dtype=torch.float32, seed=1)
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="refit"), SimpleNamespace(parallel_config=ParallelConfig(), model_config=None),
        torch.device("cpu"), source_model)
    init = engine.parse_init_info({"rendezvous": "host:1", "options": {"bucket_bytes": 1 << 20}, "loader": ["x"]})
    update = engine.parse_update_info({"version": 7})
    result["worker_engine"] = [type(engine).__name__, init.rendezvous, init.options, init.loader, update.version]
    try:
        engine.parse_init_info({"rendezvous": "", "no_such_field": 1})  # "": no trainer to tell
        result["bad_init_info"] = None
    except Exception as exc:  # noqa: BLE001 - the test reports what vLLM raised
        result["bad_init_info"] = f"{type(exc).__name__}: {exc}"

    source = transfer.RefitSource(source_model)
    metas = compat.source_metadata(source)
    params = dict(source_model.named_parameters())
    result["metadata_matches"] = [(m.name, tuple(m.shape), m.dtype == params[m.name].dtype) for m in metas] == [
        (n, tuple(p.shape), True) for n, p in params.items()]
    full = dict(source.iter_full())
    # against a second model built from the same seed: plain parameters iterate as themselves, so comparing
    # them with the source's own parameters could not fail
    rebuilt = dict(build_model(config, dtype=torch.float32, seed=1).named_parameters())
    result["iter_full_matches"] = list(full) == list(rebuilt) and all(
        same_bytes(full[n], rebuilt[n]) for n in rebuilt)

    target_model = build_model(config, dtype=torch.float32, seed=2)
    client = LocalClient(target_model)
    info = transfer.RefitTrainerInitInfo(rank=0, rendezvous=f"127.0.0.1:{free_port()}", world_size=1,
                                         options={"timeout_s": 60})
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    with torch.no_grad():
        for p in source_model.parameters():
            p.add_(0.5)
    version = trainer.send_weights(version=3)
    result["default_version"] = trainer.send_weights()  # the previous version plus 1
    trainer.shutdown()
    client.receiver.close()
    result["refused_init"] = refused_init(source, build_model(config, dtype=torch.float32, seed=3))
    result["client_refused"] = client_refused(config)
    result["update_refused"] = update_refused(config)
    result["fidelity"] = fidelity(config)
    target = dict(target_model.named_parameters())
    result["trainer"] = {"class": type(trainer).__name__, "version": version, "calls": client.calls,
                         "weight_versions": client.versions,
                         "bitwise_equal": all(same_bytes(target[n], p) for n, p in params.items())}
    return result


def main() -> None:
    if len(sys.argv) > 1:
        sys.path.insert(0, str(Path(__file__).parent))
        from vllm_releases import mount

        mount(sys.argv[1])
    try:
        result = check()
    except Exception:  # noqa: BLE001 - reported to the test
        result = {"error": traceback.format_exc()}
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
