"""The benchmark's synthetic backends: a Megatron-style trainer and a vLLM-style engine.

Both are built from a HF ``config.json`` (a preset of :mod:`refit_core.kit.models`) directly on a device,
every parameter its own allocation as in the real frameworks (so no refit message can count on two
parameters being neighbours in memory), and describe their memory as HF-space boxes:

- :class:`MegatronStyleModel` (train side, tensor parallel ``tp``, rank ``rank``): vocab-parallel
  embedding and output layer, ``linear_qkv`` interleaved per query group (``[q_g; k_g; v_g]`` for each
  local KV group, so ``q_proj`` is one piece per group), ``linear_proj`` split on columns, dense
  ``linear_fc1`` = ``[gate; up]`` shards, ``linear_fc2`` split on columns, MoE experts stacked
  ``[E, 2I, H]`` (fc1) and ``[E, H, I]`` (fc2), the grouped HF names (``...experts.gate_proj.weight``
  ``[E, I, H]`` is the strided view ``fc1[:, :I]``); :class:`MegatronSequentialStyleModel` holds every
  expert as its own ``[2I, H]`` / ``[H, I]`` parameter instead (``SequentialMLP``, TE's ``weight{e}``).
- :class:`VllmStyleModel` (gen side, ``tp``/``rank``): ``qkv_proj`` = ``[Q; K; V]`` shards,
  ``gate_up_proj`` = ``[gate; up]`` shards, ``o_proj``/``down_proj`` split on columns, MoE ``w13``
  ``[E, 2I/tp, H]`` and ``w2`` ``[E, H, I/tp]``.

Weights are random and deterministic per HF tensor (:func:`reference`), drawn on the device, so the
receiving side checks every byte by drawing them again. Register the hooks with
:func:`register` (``refit bench`` does, in code; this is not an installed plugin).

With ``fp8_block=(bn, bk)`` a model holds its linear layers' weights (q/k/v/o, gate/up/down, the
experts) as block-FP8, the layout of vLLM's and SGLang's block-FP8 layers: e4m3 values in the same
fused parameters, and beside each an fp32 ``weight_scale_inv`` parameter holding the scales of each
fused part's blocks, part after part along the rows (``[q blocks; k blocks; v blocks]``,
``[gate blocks; up blocks]`` per expert). Embeddings, norms, the router and ``lm_head`` stay in the
config's dtype. An FP8 destination is filled by refit's quantization; an FP8 *source* (a trainer
holding FP8 weights and scales) is filled with the reference quantization of its values.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from refit_core.contract.backend import GEN, TRAIN, Backend
from refit_core.contract.hookspecs import hookimpl
from refit_core.contract.pieces import DestinationMap, DestinationPiece, SourcePiece
from refit_core.contract.plugins import PluginManager, get_plugin_manager
from refit_core.contract.spec import BLOCK_SCALE_SUFFIX, Box, Quantization, TensorSpec
from refit_core.kit.models import checkpoint_specs, config_dtype, head_dim, num_experts
from refit_core.kit.verify import same_bytes
from refit_core.run.quant.fast import Quantizer
from refit_core.tools.bench.decoder_params import MEGATRON_PARAMS, VLLM_PARAMS, DecoderParams

Quantize = Callable[[torch.Tensor, Quantization], tuple[torch.Tensor, torch.Tensor]]
QUANTIZED_SUFFIXES = ("_proj.weight",)
"""HF tensors an FP8 model holds quantized (the attention and MLP linear layers, experts included)."""


def scale_name(hf_name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv`` (block-FP8 checkpoints' scale names)."""
    return hf_name + BLOCK_SCALE_SUFFIX


def fp8_specs(specs: dict[str, TensorSpec], block: tuple[int, int]) -> dict[str, TensorSpec]:
    """``specs`` with every linear weight block-FP8 (and its scale tensor added)."""
    out: dict[str, TensorSpec] = {}
    for name, spec in specs.items():
        if not name.endswith(QUANTIZED_SUFFIXES):
            out[name] = spec
            continue
        quant = Quantization.block_fp8(scale_name(name), block, experts=".experts." in name)
        out[name] = TensorSpec(name, spec.shape, quant.dtype, quant)
        out[quant.scale_name] = quant.scale_spec(spec.shape)
    return out


def reference(spec: TensorSpec, seed: int, device: torch.device) -> torch.Tensor:
    """The benchmark's value of HF tensor ``spec``: random normal, the same on every device of a kind."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    values = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32)
    return values.to(spec.dtype)


class _FlatModel:
    """Parameters (one allocation each) and the HF pieces they hold."""

    side = ""
    param_names: DecoderParams

    def __init__(self, config: dict[str, Any], *, tp: int, rank: int, device: torch.device | str,
                 fp8_block: tuple[int, int] | None = None) -> None:
        self.config = config
        self.tp, self.rank = tp, rank
        self.device = torch.device(device)
        self.dtype = config_dtype(config)
        self.hp_specs = {s.name: s for s in checkpoint_specs(config, grouped=True)}
        self.specs = dict(self.hp_specs)
        self.params: dict[str, torch.Tensor] = {}
        self.pieces: list = []
        self.version = -1
        self._declare()
        self._pieces()
        if fp8_block:  # the parameters that hold linear weights become FP8, with scales beside them
            self.specs = fp8_specs(self.hp_specs, fp8_block)
            self._quantize_params()

    # -- declaration helpers ---------------------------------------------------------------------

    def _param(self, name: str, *shape: int) -> None:
        self.params[name] = torch.empty(shape, dtype=self.dtype, device=self.device)

    def _declare(self) -> None:
        """Every parameter, in the layout's order, named by :attr:`param_names`."""
        d, t, n = self.dims, self.tp, self.param_names
        H, hd = d["H"], d["hd"]
        self._param(n.embedding, d["V"] // t, H)
        for layer in range(d["L"]):
            p = n.layer.format(layer)
            self._param(f"{p}.{n.in_norm}", H)
            self._param(f"{p}.{n.qkv}", (d["nq"] + 2 * d["nkv"]) * hd // t, H)
            if d["qk_norm"]:
                self._param(f"{p}.{n.q_norm}", hd)
                self._param(f"{p}.{n.k_norm}", hd)
            self._param(f"{p}.{n.o}", H, d["nq"] * hd // t)
            self._param(f"{p}.{n.post_norm}", H)
            if d["E"]:
                self._param(f"{p}.{n.router}", d["E"], H)
                self._declare_experts(p)
            else:
                self._param(f"{p}.{n.gate_up}", 2 * d["I"] // t, H)
                self._param(f"{p}.{n.down}", H, d["I"] // t)
        self._param(n.final_norm, H)
        self._param(n.output, d["V"] // t, H)

    def _declare_experts(self, p: str) -> None:
        raise NotImplementedError

    def _pieces(self) -> None:
        raise NotImplementedError

    def _piece(self, hf: str, offsets: tuple[int, ...], view: torch.Tensor) -> None:
        cls = SourcePiece if self.side == TRAIN else DestinationPiece
        self.pieces.append(cls(self.specs[hf], Box(offsets, tuple(view.shape)), view))

    # -- FP8 -----------------------------------------------------------------------------------

    def _quantize_params(self) -> None:
        hp_pieces, self.pieces = self.pieces, []
        owners = {p.untyped_storage().data_ptr(): n for n, p in self.params.items()}
        quantized = {owners[p.view.untyped_storage().data_ptr()] for p in hp_pieces
                     if self.specs[p.spec.name].quant is not None}
        for name in quantized:
            self.params[name] = torch.empty(self.params[name].shape, dtype=torch.float8_e4m3fn, device=self.device)
        self._pieces()
        owners = {p.untyped_storage().data_ptr(): n for n, p in self.params.items()}
        by_param: dict[str, list] = {}
        for piece in self.pieces:
            if piece.spec.quant is not None:
                by_param.setdefault(owners[piece.view.untyped_storage().data_ptr()], []).append(piece)
        for name, pieces in by_param.items():
            self._add_scales(name, pieces)

    def _add_scales(self, name: str, pieces: list) -> None:
        """An fp32 scale parameter for FP8 parameter ``name``: its parts' block rows one after another."""
        cls = SourcePiece if self.side == TRAIN else DestinationPiece
        param = self.params[name]

        def first_row(piece) -> int:
            return (piece.view.storage_offset() // param.stride(-2)) % param.shape[-2]

        placed, rows = [], 0
        for piece in sorted(pieces, key=first_row):
            box = piece.spec.quant.scale_box(piece.box)
            placed.append((piece, box, rows))
            rows += box.sizes[-2]
        cols = -(-param.shape[-1] // pieces[0].spec.quant.block[-1])
        scales = torch.empty((*param.shape[:-2], rows, cols), dtype=torch.float32, device=self.device)
        self.params[scale_name(name)] = scales
        for piece, box, first in placed:
            view = scales.narrow(-2, first, box.sizes[-2])
            self.pieces.append(cls(self.specs[piece.spec.quant.scale_name], box, view))

    @property
    def nbytes(self) -> int:
        """Bytes of HF tensor data this rank holds (the model's size, without alignment padding)."""
        return sum(p.view.numel() * p.view.element_size() for p in self.pieces)

    # -- shapes --------------------------------------------------------------------------------

    @property
    def dims(self) -> dict[str, int]:
        c = self.config
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        if heads % self.tp or kv % self.tp or c["vocab_size"] % self.tp:
            raise ValueError(f"tp={self.tp} must divide heads {heads}, kv heads {kv} and vocab {c['vocab_size']}")
        experts = num_experts(c)
        inter: int = c["moe_intermediate_size"] if experts else c["intermediate_size"]
        if inter % self.tp:
            raise ValueError(f"tp={self.tp} must divide the intermediate size {inter}")
        return {"H": c["hidden_size"], "V": c["vocab_size"], "L": c["num_hidden_layers"], "nq": heads,
                "nkv": kv, "hd": head_dim(c), "E": experts, "I": inter,
                "qk_norm": int(any(".q_norm." in n for n in self.specs))}

    def layer_names(self, layer: int) -> dict[str, str]:
        p = f"model.layers.{layer}"
        return {"in_norm": f"{p}.input_layernorm.weight", "q": f"{p}.self_attn.q_proj.weight",
                "k": f"{p}.self_attn.k_proj.weight", "v": f"{p}.self_attn.v_proj.weight",
                "o": f"{p}.self_attn.o_proj.weight", "q_norm": f"{p}.self_attn.q_norm.weight",
                "k_norm": f"{p}.self_attn.k_norm.weight", "post_norm": f"{p}.post_attention_layernorm.weight",
                "gate": f"{p}.mlp.gate_proj.weight", "up": f"{p}.mlp.up_proj.weight",
                "down": f"{p}.mlp.down_proj.weight", "router": f"{p}.mlp.gate.weight",
                "e_gate": f"{p}.mlp.experts.gate_proj.weight", "e_up": f"{p}.mlp.experts.up_proj.weight",
                "e_down": f"{p}.mlp.experts.down_proj.weight"}

    # -- values --------------------------------------------------------------------------------

    def by_name(self) -> dict[str, list]:
        out: dict[str, list] = {}
        for piece in self.pieces:
            out.setdefault(piece.spec.name, []).append(piece)
        return out

    def expected(self, seed: int, quantize: Quantize | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor)`` of every tensor this rank holds, as it must hold it: quantized
        tensors and their scales by ``quantize`` (default: refit's eager quantizer) of the values."""
        quantize = quantize or Quantizer(compiled=False).quantize
        names = self.by_name()
        scale_names = {spec.quant.scale_name for spec in self.specs.values() if spec.quant is not None}
        for name, spec in self.specs.items():
            if name in scale_names:
                continue  # yielded with the values it scales
            if spec.quant is not None:
                hp = reference(self.hp_specs[name], seed, self.device)
                values, scales = quantize(hp, spec.quant)
                del hp
                if name in names:
                    yield name, values
                if spec.quant.scale_name in names:
                    yield spec.quant.scale_name, scales
                del values, scales
            elif name in names:
                yield name, reference(spec, seed, self.device)


class MegatronStyleModel(_FlatModel):
    """Train side: Megatron-core's fused layouts (TP ``tp``, rank ``rank``; experts all local)."""

    side = TRAIN
    param_names = MEGATRON_PARAMS

    def _pieces(self) -> None:
        d, t, r, P = self.dims, self.tp, self.rank, self.params
        H, hd = d["H"], d["hd"]
        vs = d["V"] // t
        self._piece("model.embed_tokens.weight", (r * vs, 0), P["embedding.word_embeddings.weight"])
        groups = d["nkv"] // t
        per_group = d["nq"] // d["nkv"]
        for layer in range(d["L"]):
            n, p = self.layer_names(layer), f"decoder.layers.{layer}"
            self._piece(n["in_norm"], (0,), P[f"{p}.self_attention.linear_qkv.layer_norm_weight"])
            qkv = P[f"{p}.self_attention.linear_qkv.weight"].view(groups, (per_group + 2) * hd, H)
            for g in range(groups):
                gg = r * groups + g
                self._piece(n["q"], (gg * per_group * hd, 0), qkv[g, :per_group * hd])
                self._piece(n["k"], (gg * hd, 0), qkv[g, per_group * hd:(per_group + 1) * hd])
                self._piece(n["v"], (gg * hd, 0), qkv[g, (per_group + 1) * hd:])
            if d["qk_norm"]:
                self._piece(n["q_norm"], (0,), P[f"{p}.self_attention.q_layernorm.weight"])
                self._piece(n["k_norm"], (0,), P[f"{p}.self_attention.k_layernorm.weight"])
            self._piece(n["o"], (0, r * d["nq"] * hd // t), P[f"{p}.self_attention.linear_proj.weight"])
            self._piece(n["post_norm"], (0,), P[f"{p}.mlp.linear_fc1.layer_norm_weight"])
            inter = d["I"] // t
            if d["E"]:
                self._piece(n["router"], (0, 0), P[f"{p}.mlp.router.weight"])
                self._expert_pieces(n, p)
            else:
                fc1 = P[f"{p}.mlp.linear_fc1.weight"]
                self._piece(n["gate"], (r * inter, 0), fc1[:inter])
                self._piece(n["up"], (r * inter, 0), fc1[inter:])
                self._piece(n["down"], (0, r * inter), P[f"{p}.mlp.linear_fc2.weight"])
        self._piece("model.norm.weight", (0,), P["decoder.final_layernorm.weight"])
        self._piece("lm_head.weight", (r * vs, 0), P["output_layer.weight"])

    def _declare_experts(self, p: str) -> None:
        d = self.dims
        self._param(f"{p}.mlp.experts.linear_fc1.weight", d["E"], 2 * d["I"] // self.tp, d["H"])
        self._param(f"{p}.mlp.experts.linear_fc2.weight", d["E"], d["H"], d["I"] // self.tp)

    def _expert_pieces(self, n: dict[str, str], p: str) -> None:
        inter, r = self.dims["I"] // self.tp, self.rank
        fc1 = self.params[f"{p}.mlp.experts.linear_fc1.weight"]
        self._piece(n["e_gate"], (0, r * inter, 0), fc1[:, :inter])
        self._piece(n["e_up"], (0, r * inter, 0), fc1[:, inter:])
        self._piece(n["e_down"], (0, 0, r * inter), self.params[f"{p}.mlp.experts.linear_fc2.weight"])

    def fill(self, seed: int) -> None:
        """Write this rank's part of every HF tensor's benchmark values into the parameters."""
        by_name = self.by_name()
        with torch.no_grad():
            for name, full in self.expected(seed):
                for piece in by_name[name]:
                    piece.view.copy_(piece.box.slice_of(full))
                del full


class MegatronSequentialStyleModel(MegatronStyleModel):
    """Train side with every expert its own parameter (Megatron's ``SequentialMLP``
    ``local_experts.{e}.linear_fc1``, TE's ``linear_fc1.weight{e}``): thousands of small tensors."""

    def _declare_experts(self, p: str) -> None:
        d = self.dims
        for e in range(d["E"]):
            self._param(f"{p}.mlp.experts.local_experts.{e}.linear_fc1.weight", 2 * d["I"] // self.tp, d["H"])
            self._param(f"{p}.mlp.experts.local_experts.{e}.linear_fc2.weight", d["H"], d["I"] // self.tp)

    def _expert_pieces(self, n: dict[str, str], p: str) -> None:
        inter, r = self.dims["I"] // self.tp, self.rank
        for e in range(self.dims["E"]):
            fc1 = self.params[f"{p}.mlp.experts.local_experts.{e}.linear_fc1.weight"].unsqueeze(0)
            self._piece(n["e_gate"], (e, r * inter, 0), fc1[:, :inter])
            self._piece(n["e_up"], (e, r * inter, 0), fc1[:, inter:])
            fc2 = self.params[f"{p}.mlp.experts.local_experts.{e}.linear_fc2.weight"].unsqueeze(0)
            self._piece(n["e_down"], (e, 0, r * inter), fc2)


class VllmStyleModel(_FlatModel):
    """Gen side: vLLM's fused layouts (TP ``tp``, rank ``rank``)."""

    side = GEN
    param_names = VLLM_PARAMS

    def _declare_experts(self, p: str) -> None:
        d = self.dims
        self._param(f"{p}.mlp.experts.w13_weight", d["E"], 2 * d["I"] // self.tp, d["H"])
        self._param(f"{p}.mlp.experts.w2_weight", d["E"], d["H"], d["I"] // self.tp)

    def _pieces(self) -> None:
        d, t, r, P = self.dims, self.tp, self.rank, self.params
        hd = d["hd"]
        vs = d["V"] // t
        self._piece("model.embed_tokens.weight", (r * vs, 0), P["model.embed_tokens.weight"])
        q_rows, kv_rows = d["nq"] * hd // t, d["nkv"] * hd // t
        for layer in range(d["L"]):
            n, p = self.layer_names(layer), f"model.layers.{layer}"
            self._piece(n["in_norm"], (0,), P[f"{p}.input_layernorm.weight"])
            qkv = P[f"{p}.self_attn.qkv_proj.weight"]
            self._piece(n["q"], (r * q_rows, 0), qkv[:q_rows])
            self._piece(n["k"], (r * kv_rows, 0), qkv[q_rows:q_rows + kv_rows])
            self._piece(n["v"], (r * kv_rows, 0), qkv[q_rows + kv_rows:])
            if d["qk_norm"]:
                self._piece(n["q_norm"], (0,), P[f"{p}.self_attn.q_norm.weight"])
                self._piece(n["k_norm"], (0,), P[f"{p}.self_attn.k_norm.weight"])
            self._piece(n["o"], (0, r * q_rows), P[f"{p}.self_attn.o_proj.weight"])
            self._piece(n["post_norm"], (0,), P[f"{p}.post_attention_layernorm.weight"])
            inter = d["I"] // t
            if d["E"]:
                self._piece(n["router"], (0, 0), P[f"{p}.mlp.gate.weight"])
                w13 = P[f"{p}.mlp.experts.w13_weight"]
                self._piece(n["e_gate"], (0, r * inter, 0), w13[:, :inter])
                self._piece(n["e_up"], (0, r * inter, 0), w13[:, inter:])
                self._piece(n["e_down"], (0, 0, r * inter), P[f"{p}.mlp.experts.w2_weight"])
            else:
                gate_up = P[f"{p}.mlp.gate_up_proj.weight"]
                self._piece(n["gate"], (r * inter, 0), gate_up[:inter])
                self._piece(n["up"], (r * inter, 0), gate_up[inter:])
                self._piece(n["down"], (0, r * inter), P[f"{p}.mlp.down_proj.weight"])
        self._piece("model.norm.weight", (0,), P["model.norm.weight"])
        self._piece("lm_head.weight", (r * vs, 0), P["lm_head.weight"])

    def poison(self) -> None:
        """Overwrite every weight with NaN, so a byte that was not written fails the check."""
        for param in self.params.values():
            param.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype refit moves

    def mismatches(self, seed: int, quantize: Quantize | None = None) -> list[str]:
        """Every piece whose memory differs (bitwise) from the benchmark's values (FP8 tensors and
        scales: from ``quantize``, default refit's eager quantizer, of the high-precision values)."""
        bad = []
        by_name = self.by_name()
        for name, full in self.expected(seed, quantize):
            for piece in by_name[name]:
                if not same_bytes(piece.view, piece.box.slice_of(full)):
                    bad.append(f"{name}{piece.box}")
            del full
        return bad


# -- the hooks ------------------------------------------------------------------------------------

@hookimpl
def refit_register_backends(register) -> None:
    register(Backend("bench-megatron-style", frozenset({TRAIN}),
                     "refit bench: synthetic Megatron-style trainer layout"))
    register(Backend("bench-vllm-style", frozenset({GEN}), "refit bench: synthetic vLLM-style engine layout"))


@hookimpl
def refit_source_pieces(model: Any) -> list[SourcePiece] | None:
    return list(model.pieces) if isinstance(model, MegatronStyleModel) else None  # and its subclass


@hookimpl
def refit_destination_map(model: Any) -> DestinationMap | None:
    return DestinationMap(list(model.pieces)) if isinstance(model, VllmStyleModel) else None


@hookimpl
def refit_model_tensors(model: Any) -> list[tuple[str, torch.Tensor]] | None:
    """Every parameter, as refit-plugin-megatron lists a megatron-core model's: the per-step check that
    the trainer kept its memory is then one pass over them, not over every piece."""
    return list(model.params.items()) if isinstance(model, _FlatModel) else None


@hookimpl
def refit_begin_update(model: Any) -> bool | None:
    return False if isinstance(model, VllmStyleModel) else None


@hookimpl
def refit_finish_update(model: Any, version: int) -> bool | None:
    if not isinstance(model, VllmStyleModel):
        return None
    model.version = version
    return True


PLUGIN_NAME = "refit-bench"


def register(pm: PluginManager | None = None) -> PluginManager:
    """Register the benchmark backends with ``pm`` (default: the process-wide manager), once."""
    import sys

    pm = pm or get_plugin_manager()
    if not pm.has_plugin(PLUGIN_NAME):
        pm.register(sys.modules[__name__], name=PLUGIN_NAME)
    return pm
