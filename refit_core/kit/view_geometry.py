"""A strided view of a dense tensor read back as a box of it (where a traced copy lands)."""

from __future__ import annotations

from refit_core.contract.spec import Box


def view_as_box(shape: tuple[int, ...], base_stride: tuple[int, ...], offset: int,
                sizes: tuple[int, ...], strides: tuple[int, ...]) -> tuple[Box, tuple[int, ...]] | None:
    """Express a strided view of a dense base tensor as a box of it.

    Returns ``(box, dims)`` where ``dims[i]`` is the base dimension that view dimension ``i`` walks
    (-1 for view dims of size 1), or None when the view is not a box (overlapping, skewed, ...).
    """
    if len(shape) == 0:
        return (Box((), ()), tuple(-1 for _ in sizes)) if offset == 0 and all(s == 1 for s in sizes) else None
    order = sorted(range(len(shape)), key=lambda d: -base_stride[d])
    coords = [0] * len(shape)
    rest = offset
    for d in order:
        if base_stride[d] == 0:
            continue
        coords[d], rest = divmod(rest, base_stride[d])
        if shape[d] and coords[d] >= shape[d]:
            return None
    if rest:
        return None
    box_sizes = [1] * len(shape)
    used: set[int] = set()
    dims = []
    for size, stride in zip(sizes, strides):
        if size == 1:
            dims.append(-1)
            continue
        choice = [d for d in range(len(shape)) if d not in used and base_stride[d] == stride
                  and shape[d] > 1 and coords[d] + size <= shape[d]]
        if not choice:
            return None
        d = choice[0]
        used.add(d)
        box_sizes[d] = size
        dims.append(d)
    box = Box(tuple(coords), tuple(box_sizes))
    if not box.within(shape):
        return None
    return box, tuple(dims)
