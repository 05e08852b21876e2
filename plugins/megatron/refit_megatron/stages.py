"""Which transformer layers a pipeline stage holds: megatron-core's rule, for metadata layouts.

The same placement as megatron-core 0.16's ``get_transformer_layer_offset`` and
``get_num_layers_to_build`` (and ``MambaStack``'s own copy of the rule), with virtual stages and with
uneven first / last stages (``pp_first`` / ``pp_last``, megatron's
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``). The live path
does not need it: it reads each built layer's ``layer_number``, which megatron-core sets with those
functions. ``tests/megatron/test_megatron_stages.py`` holds this rule to megatron-core's functions.
"""

from __future__ import annotations

from refit_core import ParallelLayout, PluginError


def check_stages(layers: int, layout: ParallelLayout) -> None:
    """Raise :class:`PluginError` where megatron-core would refuse to split ``layers`` over ``layout``."""
    pp, vpp, first, last = layout.pp, layout.vpp, layout.pp_first, layout.pp_last
    if not layout.uneven:
        if layers % (pp * vpp):
            raise PluginError(f"{layers} layers do not split evenly over pp {pp} x vpp {vpp}; give the first / "
                              f"last stage its own layer count (pp_first=N, pp_last=N)")
        return
    for name, count in (("pp_first", first), ("pp_last", last)):
        if count % vpp:
            raise PluginError(f"{name}={count} layers do not split over vpp {vpp}")
    middle, middle_stages = layers - first - last, pp - (first > 0) - (last > 0)
    if middle < 0:
        raise PluginError(f"pp_first={first} + pp_last={last} exceed the model's {layers} layers")
    if bool(middle) != bool(middle_stages):
        raise PluginError(f"{middle} layers are left for {middle_stages} middle pipeline stages "
                          f"(pp {pp}, pp_first={first}, pp_last={last})")
    if middle_stages and middle % middle_stages:
        raise PluginError(f"the {middle} layers between pp_first={first} and pp_last={last} do not split evenly "
                          f"over the {middle_stages} middle stages")
    if middle_stages and middle // middle_stages % vpp:
        raise PluginError(f"{middle // middle_stages} layers per middle stage do not split over vpp {vpp}")


def stage_layers(layers: int, layout: ParallelLayout, pp: int, vp: int = 0) -> range:
    """The global layer numbers (0-based) of virtual chunk ``vp`` of pipeline stage ``pp``."""
    check_stages(layers, layout)
    vpp = layout.vpp
    if not layout.uneven:
        per = layers // (layout.pp * vpp)
        start = (vp * layout.pp + pp) * per
        return range(start, start + per)
    first, last = layout.pp_first // vpp, layout.pp_last // vpp  # per virtual chunk
    middle_stages = layout.pp - (layout.pp_first > 0) - (layout.pp_last > 0)
    middle = (layers - layout.pp_first - layout.pp_last) // middle_stages // vpp if middle_stages else 0
    if pp == 0 and layout.pp_first:
        count = first
    elif pp == layout.pp - 1 and layout.pp_last:
        count = last
    else:
        count = middle
    start = vp * (layers // vpp)
    if pp:
        start += first + (pp - (layout.pp_first > 0)) * middle
    return range(start, start + count)
