"""No import cycle among vllm_hicache's modules.

The floors themselves are import-linter's contracts (pyproject.toml,
``make lint``); this test checks what a layers contract cannot: that no two
modules reach each other at all, lazy and TYPE_CHECKING imports included.
``ALLOWED_CYCLES`` lists the cycles still known; the test fails when one of
them is gone too, so the list only ever shrinks.
"""

from __future__ import annotations

import grimp

# Empty: every cycle is gone. A cycle added later is a failure, not an entry.
ALLOWED_CYCLES: set[frozenset[str]] = set()


def _children(graph, module: str):
    return iter(sorted(graph.find_modules_directly_imported_by(module)))


def import_cycles(graph) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's
    algorithm, iterative: the graph is small but Python's stack is too)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: set[frozenset[str]] = set()
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, _children(graph, root))]
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
                    work.append((child, _children(graph, child)))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.add(frozenset(component))
    return cycles


def test_cycle_finder_finds_a_cycle():
    """Negative control: a two-module cycle is found, a chain is not."""
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.y", imported="a.z")
    assert import_cycles(graph) == {frozenset({"a.x", "a.y"})}


def test_no_import_cycles():
    cycles = import_cycles(grimp.build_graph("vllm_hicache"))
    new = cycles - ALLOWED_CYCLES
    assert not new, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in new)
    stale = ALLOWED_CYCLES - cycles
    assert not stale, ("cycles in ALLOWED_CYCLES no longer exist; remove them: "
                       + "; ".join(" <-> ".join(sorted(c)) for c in stale))
