"""From a trace of an engine's own loaders to refit's destination map: fast-path pieces and loader tensors.

An engine *module* (``qkv_proj``, ``experts``, a norm, ...) takes the fast path when every byte of
every tensor it loads is written by plain box copies from HF tensors (or constant padding fills),
without overlaps, and its quantization method stores weights as loaded (unquantized). Everything
else -- quantized modules, loaders that compute, layers partly missing from the checkpoint, names a
user forces -- takes the loader path, whole: an HF tensor that touches a loader module goes to the
loader, and every module it touches follows, until nothing changes. So fused groups stay complete
(q, k and v share ``qkv_proj``; gate and up share ``gate_up_proj`` / ``w13_weight``) by construction.

Per-expert writes of one expert group into one parameter are merged into grouped pieces
(``...experts.gate_proj.weight`` boxes ``[e0:e1, rows, cols]`` viewing ``w13_weight[e0:e1, :I]``), so
a layer's experts move as a few strided regions rather than one piece per expert. Shared by the
vLLM and SGLang plugins; each gives its tracer (:mod:`refit_core.kit.loadtrace`) and quantization rules.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace

import torch

from refit_core.contract.experts import ExpertName, count_experts
from refit_core.contract.spec import Box, TensorSpec
from refit_core.kit.loadtrace import Fill, Target, Trace, Write
from refit_core.plan.regions import first_overlap

log = logging.getLogger("refit")

Key = tuple[str, str]


@dataclass(frozen=True)
class PlannedPiece:
    """A destination piece before it is bound to memory: ``tensor.as_strided(box.sizes, strides, offset)``."""

    spec: TensorSpec
    box: Box
    target: Key
    offset: int
    strides: tuple[int, ...]


@dataclass
class ModelPlan:
    """Where every HF tensor of one engine model (this rank) goes."""

    pieces: list[PlannedPiece]
    loader: list[TensorSpec]
    targets: dict[Key, Target]
    fast_modules: list[str]
    zero: list[Key] = field(default_factory=list)
    """Fast targets with elements no loader writes (padding): zeroed after materializing."""
    fills: list[Fill] = field(default_factory=list)
    loader_reasons: dict[str, str] = field(default_factory=dict)
    """Loader-path module -> why it is not on the fast path."""
    skipped: dict[str, str] = field(default_factory=dict)
    """HF name -> why this rank receives nothing for it."""
    tied: list[str] = field(default_factory=list)
    """Modules sharing a tensor with an updated module (a tied ``lm_head``): re-processed at finish."""

    def summary(self) -> str:
        return (f"{len(self.pieces)} fast-path pieces into {len(self.fast_modules)} modules, "
                f"{len(self.loader)} loader-path tensors, {len(self.skipped)} tensors not on this rank")


def _target_status(target: Target, writes: list[Write], fills: list[Fill]) -> tuple[str | None, bool]:
    """(why not fast or None, whether untouched elements must be zeroed first)."""
    boxes = [w.dst_box for w in writes] + [f.dst_box for f in fills]
    pair = first_overlap(boxes)
    if pair is not None:
        return f"{target.name}: regions {pair[0]} and {pair[1]} are written twice", False
    written = sum(w.dst_box.numel for w in writes)
    covered = written + sum(f.dst_box.numel for f in fills)
    if covered == target.numel:
        return None, False
    if written == target.load_numel:  # padding the loader leaves alone
        return None, True
    return f"{target.name}: checkpoint covers {covered} of {target.numel} elements", False


def _quant_method_name(model: torch.nn.Module, module: str) -> str | None:
    method = getattr(model.get_submodule(module), "quant_method", None)
    return None if method is None else type(method).__name__


def _expert_runs(entries: list[tuple[int, Write]]) -> Iterable[list[tuple[int, Write]]]:
    """Split same-shaped per-expert writes into runs of consecutive experts at a constant stride."""
    run: list[tuple[int, Write]] = []
    for entry in sorted(entries, key=lambda e: e[0]):
        if run:
            step = entry[1].offset - run[-1][1].offset
            consecutive = entry[0] == run[-1][0] + 1
            steady = len(run) < 2 or step == run[-1][1].offset - run[-2][1].offset
            if not (consecutive and steady and step > 0):
                yield run
                run = []
        run.append(entry)
    if run:
        yield run


def plan_model(model: torch.nn.Module, specs: list[TensorSpec], *,
               namer: Callable[[str], ExpertName | None],
               tracer: Callable[[torch.nn.Module, list[TensorSpec]], Trace],
               fast_quant_methods: Collection[str],
               loader_patterns: Iterable[str] = ()) -> ModelPlan:
    """Trace ``model``'s loaders for ``specs`` (HF tensors, per-expert names) and split fast / loader.

    ``tracer`` is the engine's :func:`refit_core.kit.loadtrace.trace_loads` (its swap); modules whose
    ``quant_method`` class is not in ``fast_quant_methods`` take the loader path; HF names matching
    ``loader_patterns`` (regular expressions) are forced onto it.
    """
    trace = tracer(model, specs)
    if trace.cast:  # tensors the engine keeps in another dtype (an fp32 router, ...): ask in that dtype
        specs = [replace(s, dtype=trace.cast.get(s.name, s.dtype)) for s in specs]
        trace = tracer(model, specs)
    return _split(model, specs, trace, namer, [re.compile(p) for p in loader_patterns], frozenset(fast_quant_methods))


def _split(model: torch.nn.Module, specs: list[TensorSpec], trace: Trace,
           namer: Callable[[str], ExpertName | None], forced: list[re.Pattern],
           fast_quant_methods: frozenset[str]) -> ModelPlan:
    by_name = {s.name: s for s in specs}
    writes: dict[Key, list[Write]] = defaultdict(list)
    for w in trace.writes:
        writes[w.target].append(w)
    fills: dict[Key, list[Fill]] = defaultdict(list)
    for f in trace.fills:
        fills[f.target].append(f)
    modules_of = {name: {key[0] for key in keys} for name, keys in trace.touched.items()}
    touched_modules = {m for mods in modules_of.values() for m in mods}

    reasons: dict[str, str] = {}
    zero: list[Key] = []
    for key, target in trace.targets.items():
        if target.module not in touched_modules:
            continue
        if key in trace.opaque:
            reasons.setdefault(target.module, f"{target.name}: {trace.opaque[key]}")
            continue
        why, needs_zero = _target_status(target, writes.get(key, []), fills.get(key, []))
        if why is not None:
            reasons.setdefault(target.module, why)
        elif needs_zero:
            zero.append(key)
    for module in sorted(touched_modules):
        method = _quant_method_name(model, module)
        if method is not None and method not in fast_quant_methods:
            reasons.setdefault(module, f"quantization method {method}")

    loader_names = {n for n in modules_of if any(p.search(n) for p in forced)}
    for name in loader_names:
        for module in modules_of[name]:
            reasons.setdefault(module, f"{name} is forced onto the loader path")
    while True:  # close over shared modules: fused groups go to the loader together
        grown = {n for n, mods in modules_of.items() if mods & reasons.keys()} - loader_names
        for name in grown:
            for module in modules_of[name] - reasons.keys():
                reasons[module] = f"shares tensors with {name}, which takes the loader path"
        if not grown:
            break
        loader_names |= grown

    skipped = {n: f"rejected by the model's load_weights: {why}" for n, why in trace.rejected.items()}
    skipped.update({s.name: "loads into nothing on this rank" for s in specs
                    if s.name not in modules_of and s.name not in skipped})

    pieces = _pieces(by_name, [w for w in trace.writes if w.hf_name not in loader_names], namer)
    loader = _loader_specs([by_name[n] for n in by_name if n in loader_names], namer, by_name)
    fast_modules = sorted(touched_modules - reasons.keys())
    fast = set(fast_modules)
    tied = sorted({alias[0] for alias, owner in trace.aliases.items() if owner[0] in touched_modules})
    return ModelPlan(
        pieces=pieces, loader=loader, targets=trace.targets, fast_modules=fast_modules, tied=tied,
        zero=[k for k in zero if k[0] in fast], fills=[f for f in trace.fills if f.target[0] in fast],
        loader_reasons={m: why for m, why in reasons.items() if m in touched_modules}, skipped=skipped)


def _pieces(by_name: dict[str, TensorSpec], writes: list[Write],
            namer: Callable[[str], ExpertName | None]) -> list[PlannedPiece]:
    counts = count_experts(by_name, namer)
    out: list[PlannedPiece | None] = []
    experts: dict[tuple, list[tuple[int, Write]]] = {}
    slot: dict[tuple, int] = {}
    for w in writes:
        spec = by_name[w.hf_name]
        expert = namer(w.hf_name)
        if expert is None:
            out.append(PlannedPiece(spec, w.hf_box, w.target, w.offset, w.strides))
            continue
        key = (expert.group, w.target, w.hf_box, w.strides)
        if key not in experts:
            experts[key] = []
            slot[key] = len(out)
            out.append(None)
        experts[key].append((expert.index, w))
    grouped: dict[int, list[PlannedPiece]] = {}
    for key, entries in experts.items():
        group, target, inner, strides = key
        spec = by_name[entries[0][1].hf_name]
        group_spec = TensorSpec(group, (counts[group], *spec.shape), spec.dtype)
        grouped[slot[key]] = []
        for run in _expert_runs(entries):
            first, w = run[0]
            step = run[1][1].offset - w.offset if len(run) > 1 else 0
            box = Box((first, *inner.offsets), (len(run), *inner.sizes))
            grouped[slot[key]].append(PlannedPiece(group_spec, box, target, w.offset, (step, *strides)))
    result: list[PlannedPiece] = []
    for index, piece in enumerate(out):
        result.extend(grouped[index] if piece is None else [piece])
    return result


def _loader_specs(specs: list[TensorSpec], namer: Callable[[str], ExpertName | None],
                  by_name: dict[str, TensorSpec]) -> list[TensorSpec]:
    """Loader tensors, per-expert names folded into whole grouped tensors (the core splits them back)."""
    counts = count_experts(by_name, namer)
    out: list[TensorSpec] = []
    seen: set[str] = set()
    for spec in specs:
        expert = namer(spec.name)
        if expert is None:
            out.append(spec)
        elif expert.group not in seen:
            seen.add(expert.group)
            quant = spec.quant
            if quant is not None:  # stacked scales under their grouped name
                scale = namer(quant.scale_name)
                quant = quant.stacked(scale.group if scale is not None else quant.scale_name)
            out.append(TensorSpec(expert.group, (counts[expert.group], *spec.shape), spec.dtype, quant))
    return out
