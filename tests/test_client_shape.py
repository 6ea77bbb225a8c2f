"""Shape of the client distribution (``client/kvseal``: ``kvseal.client``,
``kvseal.vllm``, ``kvseal.v1``): no import cycles, no module over 650 lines.

The import graph is read from the sources with :mod:`ast`, never by importing
them (``kvseal.vllm`` needs vLLM, which this venv does not have). Every
``import`` statement counts, wherever it is: at module level, under
``if TYPE_CHECKING:`` (a type-only dependency is still a dependency: it ties
the two modules' designs together, and one refactor away it is a runtime
import), inside a function, or in a ``try``.

An edge goes to the module an import names: ``from P import name`` to
``P.name`` when that is a module, else to ``P``. The implicit import of a
module's parent packages is not an edge: a package's ``__init__`` that
re-exports its children is the usual facade, not a cycle; a child that imports
its own package's ``__init__`` (``from kvseal.client import X`` inside
``kvseal.client``) is, and is reported.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kvseal.client
from kvseal.client import client as client_module

ROOT = Path(__file__).resolve().parents[1]
CLIENT_SRC = ROOT / "client"  # holds the kvseal/ namespace package of the client distribution
MAX_LINES = 650


@dataclass(frozen=True)
class Edge:
    """One import statement of ``src`` that names ``dst``."""

    src: str
    dst: str
    line: int
    kind: str  # "top-level", "TYPE_CHECKING" or "function-local"


def _modules(src_root: Path) -> dict[str, Path]:
    """Dotted name → file of every module under ``src_root`` (a source root:
    the directory that holds the top-level package)."""
    found: dict[str, Path] = {}
    for path in sorted(src_root.rglob("*.py")):
        parts = list(path.relative_to(src_root).with_suffix("").parts)
        if parts[0] == "build":  # the output of a local pip build, not source
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """Collects (imported name candidates, line, kind) for one module."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[list[str], int, str]] = []
        self._kind = ["top-level"]

    def _nested(self, node: ast.AST, kind: str) -> None:
        self._kind.append(kind)
        self.generic_visit(node)
        self._kind.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._nested(node, "function-local")

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._nested(node, "function-local")

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._kind.append("TYPE_CHECKING")
        for child in node.body:
            self.visit(child)
        self._kind.pop()
        for child in node.orelse:  # the ``else`` of TYPE_CHECKING runs at import time
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append(([alias.name], node.lineno, self._kind[-1]))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            # ``from P import name``: the submodule P.name if there is one, else P.
            names = [base] if alias.name == "*" else [f"{base}.{alias.name}", base]
            self.found.append((names, node.lineno, self._kind[-1]))


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module of ``known`` that importing ``name`` loads last: ``name``
    itself, or its nearest known parent (``import a.b.c`` of a package that has
    no ``c`` module). None for anything outside ``known``."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def import_edges(src_root: Path) -> list[Edge]:
    """Every import between two modules under ``src_root``."""
    known = _modules(src_root)
    edges: list[Edge] = []
    for module, path in known.items():
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        for names, line, kind in visitor.found:
            dst = next((m for m in (_resolve(n, known) for n in names) if m), None)
            if dst is not None and dst != module:
                edges.append(Edge(module, dst, line, kind))
    return edges


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges, in order) per strongly connected component of
    more than one module; empty when the graph is acyclic."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.src, {}).setdefault(e.dst, e)
        graph.setdefault(e.dst, {})
    # Tarjan's algorithm, iterative (no recursion limit on deep graphs).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    cycles = []
    for component in components:
        # A shortest way from the component's first module back to itself, inside it.
        start = min(component)
        came_from: dict[str, Edge] = {}
        frontier = [start]
        while start not in came_from:
            step = []
            for node in frontier:
                for dst, e in sorted(graph[node].items()):
                    if dst in component and dst not in came_from:
                        came_from[dst] = e
                        step.append(dst)
            frontier = step
        path = [came_from[start]]
        while path[-1].src != start:
            path.append(came_from[path[-1].src])
        cycles.append(path[::-1])
    return cycles


def _describe(cycle: list[Edge]) -> str:
    hops = " -> ".join(f"{e.src} (line {e.line}, {e.kind})" for e in cycle)
    return f"{hops} -> {cycle[0].src}"


def test_client_distribution_has_no_import_cycles() -> None:
    edges = import_edges(CLIENT_SRC)
    # The graph was really read: the known edges of both packages are in it.
    pairs = {(e.src, e.dst) for e in edges}
    assert ("kvseal.client.engine_pool", "kvseal.client.client") in pairs
    assert ("kvseal.client.torch_pool", "kvseal.client.shm") in pairs  # TYPE_CHECKING
    assert ("kvseal.vllm.worker", "kvseal.core.kv_pool") in pairs
    cycles = find_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c) for c in cycles)


def test_no_client_module_over_650_lines() -> None:
    modules = _modules(CLIENT_SRC)
    assert {"kvseal.client.client", "kvseal.vllm.spec"} <= modules.keys()
    too_long = {
        name: n
        for name, path in modules.items()
        if not (name.startswith("kvseal.v1.") and "_pb2" in path.name)  # generated
        and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"


def test_the_cycle_finder_sees_type_only_and_local_imports(tmp_path: Path) -> None:
    """The checker above is only as good as its parser: cycles closed by a
    TYPE_CHECKING import, a function-local import, a relative import or a
    package's own ``__init__`` are found; a facade ``__init__`` is not one."""
    files = {
        "pkg/__init__.py": "from pkg.a import A\nfrom pkg.e import E\n",
        "pkg/a.py": "import pkg.b\nA = 1\n",
        "pkg/b.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.a import A
            """,
        "pkg/c.py": "def f():\n    from . import d\n",
        "pkg/d.py": "from .c import f\n",
        "pkg/e.py": "from pkg import A\nE = A\n",  # its own package's __init__
        "pkg/sub/__init__.py": "from pkg.sub.ok import X\n",  # a facade: no cycle
        "pkg/sub/ok.py": "from .. import a\nX = 1\n",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    cycles = find_cycles(import_edges(tmp_path))
    found = sorted(sorted({e.src for e in c}) for c in cycles)
    assert found == [["pkg", "pkg.e"], ["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]], found
    kinds = {e.kind for c in cycles for e in c}
    assert {"TYPE_CHECKING", "function-local"} <= kinds


def test_public_names_keep_their_homes() -> None:
    """Splitting ``client.py`` moved no public name: ``kvseal.client`` exports
    what it did, and ``kvseal.client.client`` still offers the names it
    defined (EnginePool aside: it builds on KVSealClient, so re-exporting it
    from ``client`` would be a cycle; it lives in ``kvseal.client.engine_pool``
    and in ``kvseal.client``)."""
    assert sorted(kvseal.client.__all__) == [
        "ClientConfig",
        "EnginePool",
        "KVSealClient",
        "KVSealRpcError",
        "LookupResult",
        "NONE_HASH",
        "OffloadResult",
        "PoolHandle",
        "PoolHold",
        "RestoreResult",
        "chain_block_hashes",
        "deployment_identity",
        "load_tenant_key",
        "tenant_digest",
    ]
    for name in client_module.__all__:
        public = getattr(kvseal.client, name, None)
        assert public is None or public is getattr(client_module, name), name
    assert {"ClientConfig", "KVSealClient", "KVSealRpcError", "default_target"} <= set(
        client_module.__all__
    )


# Which client packages each package may import (kvseal.v1 is generated and
# imports nothing of ours). The two engine adapters share kvseal.core and never
# reach into each other: a change made for one engine must not reach the other
# untested. kvseal.core and kvseal.client import no adapter.
ALLOWED_LAYERS: dict[str, frozenset[str]] = {
    "kvseal.client": frozenset({"kvseal.client", "kvseal.v1"}),
    "kvseal.core": frozenset({"kvseal.core", "kvseal.client", "kvseal.v1"}),
    "kvseal.vllm": frozenset({"kvseal.vllm", "kvseal.core", "kvseal.client", "kvseal.v1"}),
    "kvseal.sglang": frozenset({"kvseal.sglang", "kvseal.core", "kvseal.client", "kvseal.v1"}),
}


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] == "kvseal" else None


def layer_violations(edges: list[Edge]) -> list[str]:
    """Every edge from a package in :data:`ALLOWED_LAYERS` to a kvseal package it
    may not import, as ``src (line N, kind) -> dst``."""
    bad = []
    for e in edges:
        src, dst = _package_of(e.src), _package_of(e.dst)
        if src in ALLOWED_LAYERS and dst is not None and dst not in ALLOWED_LAYERS[src]:
            bad.append(f"{e.src} (line {e.line}, {e.kind}) -> {e.dst}")
    return sorted(bad)


def test_engine_adapters_share_the_core_and_never_import_each_other() -> None:
    edges = import_edges(CLIENT_SRC)
    pairs = {(e.src, e.dst) for e in edges}
    # The graph was really read: both adapters use the shared core.
    assert ("kvseal.sglang.tier", "kvseal.core.kv_pool") in pairs
    assert ("kvseal.vllm.worker", "kvseal.core.kv_pool") in pairs
    packages = {_package_of(m) for m in _modules(CLIENT_SRC)}
    assert packages - {None, "kvseal.v1"} == set(ALLOWED_LAYERS), packages
    bad = layer_violations(edges)
    assert not bad, "imports across layers:\n" + "\n".join(bad)


def test_the_layer_check_sees_an_adapter_importing_the_other(tmp_path: Path) -> None:
    """The layer rule fails on what it must: the SGLang adapter importing the vLLM
    one (even under TYPE_CHECKING or inside a function), or the core importing
    an adapter."""
    files = {
        "kvseal/sglang/tier.py": "def f():\n    from kvseal.vllm.mirror import M\n",
        "kvseal/sglang/ok.py": "from kvseal.core import kv_pool\n",
        "kvseal/vllm/worker.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvseal.sglang.tier\n"
        ),
        "kvseal/core/kv_pool.py": "from kvseal.vllm import logs\n",
        "kvseal/vllm/mirror.py": "M = 1\n",
        "kvseal/vllm/logs.py": "",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    bad = layer_violations(import_edges(tmp_path))
    assert [b.split(" ")[0] for b in bad] == [
        "kvseal.core.kv_pool",
        "kvseal.sglang.tier",
        "kvseal.vllm.worker",
    ], bad
