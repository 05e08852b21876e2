"""Print refit_core's import graph as floors and circles (module level), for reviews of the layout.

A module's floor is one above the highest floor it imports (modules importing nothing of refit's stand
on floor 0); a circle is a set of modules that import each other in a loop (imports under TYPE_CHECKING
and inside functions count). ``--rooms`` counts each subpackage of the package as one room (its modules
folded into it), the way a reader sees the folders. ``python scripts/import-graph.py [--package refit_core]
[--rooms]``
"""

from __future__ import annotations

import argparse
import sys

import grimp


def strongly_connected(nodes: set[str], edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                out.append(component)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--package", default="refit_core")
    parser.add_argument("--rooms", action="store_true", help="fold every subpackage into one node")
    args = parser.parse_args()
    graph = grimp.build_graph(args.package)
    depth = args.package.count(".") + 2

    def room(module: str) -> str:
        return ".".join(module.split(".")[:depth]) if args.rooms else module

    nodes = {room(m) for m in graph.modules}
    edges: dict[str, set[str]] = {n: set() for n in nodes}
    for module in graph.modules:
        edges[room(module)] |= {room(i) for i in graph.find_modules_directly_imported_by(module)
                                if room(i) in nodes and room(i) != room(module)}
    components = strongly_connected(nodes, edges)
    owner = {m: n for n, c in enumerate(components) for m in c}
    floor: dict[int, int] = {}
    for n, component in enumerate(components):  # Tarjan emits a component after everything it imports
        below = {owner[i] for m in component for i in edges[m]} - {n}
        floor[n] = 1 + max((floor[b] for b in below), default=-1)
    circles = [sorted(c) for c in components if len(c) > 1]
    arrows = sum(len(e) for e in edges.values())
    print(f"{args.package}: {len(nodes)} {'rooms' if args.rooms else 'modules'}, {arrows} import arrows, "
          f"{1 + max(floor.values())} floors, {len(circles)} circles")
    for circle in circles:
        print("  circle: " + " <-> ".join(m.removeprefix(args.package + ".") for m in circle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
