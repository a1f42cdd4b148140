"""host/ and kernels/ import in one direction only: no cycle, no arrow up.

The graph is read from the source (every ``import`` statement, also those
inside functions and under ``TYPE_CHECKING``), so a lazy import cannot hide
an edge. ``host`` sits below ``kernels``; neither may import ``config`` (it
imports their name lists) nor anything above them. The public names of both
packages load lazily; each must still resolve.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "vllm_hicache"

# Subpackage -> what it may import from vllm_hicache, itself included.
# lazy_exports: a leaf below every package (it imports nothing of ours).
ALLOWED = {
    "vllm_hicache.host": ("vllm_hicache.host", "vllm_hicache.lazy_exports"),
    "vllm_hicache.kernels": ("vllm_hicache.kernels", "vllm_hicache.host",
                             "vllm_hicache.lazy_exports"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """vllm_hicache modules ``source`` (module ``name``) imports."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # `from pkg import submodule` is an edge to the submodule.
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
    return {m for m in found if m in known}


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    names = {p: module_name(p) for p in paths}
    known = set(names.values())
    return {
        names[p]: imported_modules(p.read_text(), names[p], p.name == "__init__.py", known)
        for p in paths
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a list of modules ([] when acyclic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def package_graph() -> dict[str, set[str]]:
    return import_graph(sorted(PACKAGE_ROOT.rglob("*.py")))


def test_find_cycle_sees_a_cycle():
    """Negative control: the walker reports a cycle made through a lazy import."""
    sources = {
        "vllm_hicache.kernels.a": "from vllm_hicache.kernels import b\n",
        "vllm_hicache.kernels.b": "def f():\n    from vllm_hicache.kernels.a import x\n",
    }
    known = set(sources)
    graph = {n: imported_modules(s, n, False, known) for n, s in sources.items()}
    assert find_cycle(graph) == [
        "vllm_hicache.kernels.a", "vllm_hicache.kernels.b", "vllm_hicache.kernels.a"]


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_subpackage_has_no_import_cycle(subpackage):
    graph = package_graph()
    inside = {m: {n for n in deps if n.startswith(subpackage)}
              for m, deps in graph.items() if m.startswith(subpackage)}
    assert find_cycle(inside) == []


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_subpackage_imports_only_downward(subpackage):
    upward = {
        (module, dep)
        for module, deps in package_graph().items() if module.startswith(subpackage)
        for dep in deps if not dep.startswith(ALLOWED[subpackage])
    }
    assert not upward, f"{subpackage} imports modules above it: {sorted(upward)}"


def test_config_takes_the_name_lists_from_their_owners():
    import vllm_hicache.config as config
    from vllm_hicache.host import layout_names
    from vllm_hicache.kernels import io_backends

    assert config.MEM_LAYOUTS is layout_names.MEM_LAYOUTS
    assert config.IO_BACKENDS is io_backends.IO_BACKENDS


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_every_public_name_resolves(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018

