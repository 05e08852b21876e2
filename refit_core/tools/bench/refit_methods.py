"""refit itself as a ``refit bench`` method, and ``refit-quantize-after``: refit into a BF16 copy of an FP8
engine's layout, which the engine then quantizes (the baseline of sender-side quantization)."""

from __future__ import annotations

from typing import Any

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.options import RefitOptions
from refit_core.endpoints.receiver import RefitReceiver
from refit_core.endpoints.sender import RefitSender
from refit_core.run.timing import Timeline
from refit_core.tools.bench.method import Method


class Refit(Method):
    """refit itself; a variant's ``settings`` (dotted :class:`RefitOptions` names) apply on both sides."""

    name = "refit"
    settings: dict[str, object] = {}

    def setup(self) -> None:
        c = self.ctx
        options = RefitOptions(bucket_bytes=c.bucket_bytes, num_buffers=c.num_buffers, timeout_s=c.timeout_s)
        options = options.overridden(self.settings) if self.settings else options
        endpoint: RefitSender | RefitReceiver
        if c.is_train:
            endpoint = RefitSender(self.endpoint_model(), rendezvous=c.refit_address(self.name), rank=c.side_rank,
                                   world_size=c.side_size, options=options, plugins=c.plugins)
        else:
            endpoint = RefitReceiver(self.endpoint_model(), rendezvous=c.refit_address(self.name), rank=c.side_rank,
                                     world_size=c.side_size, options=options, plugins=c.plugins)
        self.endpoint = endpoint
        self.schedule = endpoint.setup()
        if c.extra.get("timeline"):
            endpoint.timeline = Timeline(c.device)  # every step: the last one is drawn
        transport = endpoint.transport
        summary = self.schedule.summary
        self.info.update(messages=summary.messages, segments=summary.segments, rounds=summary.rounds,
                         transport=str(getattr(transport, "backend", transport.kind if transport else "")),
                         transport_mode=getattr(transport, "mode", ""))
        built = getattr(transport, "choice", None)  # NCCL: the communicators per link and their max CTAs
        if built is not None:
            self.info.update(comms_per_link=built.comms_per_link, max_ctas=built.max_ctas)

    def endpoint_model(self) -> Any:
        """The model refit reads (train) or writes (gen): the benchmark's own by default."""
        return self.ctx.model

    def _executor_info(self) -> None:
        side = "send" if self.ctx.is_train else "recv"
        self.info["links"] = sorted({link.value for link in self.endpoint.links.values()})
        try:
            ex = self.endpoint.executor
        except RefitError:  # every pair of this rank is colocated (CUDA IPC): nothing staged
            self.info[f"{side}_staging_bytes"] = 0
            return
        staged_rounds = sum(1 for p in ex.plans if p.staged_bytes)
        self.info[f"{side}_direct_bytes"] = ex.direct_bytes
        self.info[f"{side}_staging_bytes"] = min(ex.num_buffers, staged_rounds) * ex.buffer_bytes

    def step(self, index: int) -> None:
        if isinstance(self.endpoint, RefitSender):
            self.endpoint.send(version=index)
        else:
            stats = self.endpoint.receive()
            if stats.version != index:
                raise AssertionError(f"received version {stats.version}, expected {index}")
        if index == 0:
            self._executor_info()

    def recorded(self) -> dict[str, Any]:
        """This rank's setup breakdown and, with ``--timeline``, its last step's spans (JSON)."""
        out: dict[str, Any] = {}
        times = self.endpoint.setup_times
        if times is not None:
            out["setup"] = times.to_json()
        last = self.endpoint.last_timeline  # None: every pair colocated, no network executor to record
        if last is not None:
            out["timeline"] = last.to_json()
        return out

    def close(self) -> None:
        self.endpoint.close()


class RefitQuantizeAfter(Refit):
    """Baseline for FP8 destinations: refit BF16 into a BF16 copy of the engine's layout, then quantize."""

    name = "refit-quantize-after"

    def endpoint_model(self) -> Any:
        c = self.ctx
        if c.is_train:
            return c.model
        from refit_core.run.quant.batched import QuantizeInto, TensorsToQuantize
        from refit_core.run.quant.fast import default_quantizer
        from refit_core.tools.bench.layouts import VllmStyleModel

        fp8 = c.model
        if not any(p.spec.quant is not None for p in fp8.pieces):
            raise ValueError(f"{self.name} needs a block-FP8 destination (refit bench --fp8-block)")
        self.staging = VllmStyleModel(fp8.config, tp=fp8.tp, rank=fp8.rank, device=fp8.device)
        hp = {(p.spec.name, p.box): p.view for p in self.staging.pieces}
        scales = {(p.spec.name, p.box): p.view for p in fp8.pieces}
        work = [TensorsToQuantize(hp[(p.spec.name, p.box)], p.view,
                                  scales[(p.spec.quant.scale_name, p.spec.quant.scale_box(p.box))], p.spec.quant)
                for p in fp8.pieces if p.spec.quant is not None]
        self.copies = [(p.view, hp[(p.spec.name, p.box)]) for p in fp8.pieces
                       if p.spec.quant is None and (p.spec.name, p.box) in hp]
        self.info["receiver_bf16_copy_bytes"] = self.info["bytes_moved"] = self.staging.nbytes
        # the same batched kernel as refit's pack step, writing the engine's tensors by address
        self.quantize = QuantizeInto(work, default_quantizer())
        self.quantize.warm_up()  # compile here, not inside a timed step
        return self.staging

    def step(self, index: int) -> None:
        super().step(index)
        if self.ctx.is_train:
            return
        with torch.no_grad():
            torch._foreach_copy_([d for d, _ in self.copies], [s for _, s in self.copies])
            self.quantize.run()
        self.ctx.model.version = index

    def close(self) -> None:
        super().close()
        self.copies = []
        self.__dict__.pop("quantize", None)
        self.__dict__.pop("staging", None)  # the BF16 copy of the engine's layout


__all__ = ["Refit", "RefitQuantizeAfter"]
