"""Shape of the benchmark and script trees (``bench/``, ``scripts/``): no
import cycles, no module over the 650-line limit, like the packages
(tests/test_layout.py, tests/test_client_shape.py).

The benchmark scripts run as ``python bench/X.py`` (their directory is first on
``sys.path``, so ``from bench_cpu import ...`` names ``bench/bench_cpu.py``) and
the serving benchmark as the package ``bench.serving``: both spellings are
resolved to the same file here, so that a cycle closed through either is seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_client_shape import MAX_LINES, Edge, _Imports, _modules, _resolve, find_cycles

ROOT = Path(__file__).resolve().parents[1]
TREES = ("bench", "scripts")


def _known(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file for every module of the trees under ``root``, under
    both names a top-level script of ``bench/`` is imported by
    (``bench.bench_cpu`` and ``bench_cpu``)."""
    known = {n: p for n, p in _modules(root).items() if n.split(".")[0] in TREES}
    for name, path in list(known.items()):
        top, _, rest = name.partition(".")
        if top == "bench" and rest and "." not in rest:
            known.setdefault(rest, path)
    return known


def bench_edges(root: Path = ROOT) -> list[Edge]:
    """Every import between two modules of the trees, by file (an alias is one module)."""
    known = _known(root)
    # The full dotted name names a file (the last write, the longest name, wins).
    canonical = {p: n for n, p in sorted(known.items(), key=lambda kv: len(kv[0]))}
    edges: list[Edge] = []
    for path, module in sorted(canonical.items()):
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        for names, line, kind in visitor.found:
            dst = next((m for m in (_resolve(n, known) for n in names) if m), None)
            if dst is not None and canonical[known[dst]] != module:
                edges.append(Edge(module, canonical[known[dst]], line, kind))
    return edges


def test_bench_and_scripts_have_no_import_cycles() -> None:
    edges = bench_edges()
    pairs = {(e.src, e.dst) for e in edges}
    # The graph was really read, through both spellings.
    assert ("bench.leak_surface", "bench.bench_cpu") in pairs  # ``from bench_cpu import``
    assert ("bench.leak_surface", "bench.leak_measure") in pairs
    assert ("bench.serving.run", "bench.serving.sglang_arm") in pairs  # function-local
    cycles = find_cycles(edges)
    hops = [" -> ".join(f"{e.src} (line {e.line}, {e.kind})" for e in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(hops)


def test_a_cycle_through_a_script_alias_is_found(tmp_path: Path) -> None:
    """The alias is what makes this check worth having: ``bench/a.py``
    importing ``b`` (as a script does) and ``bench/b.py`` importing
    ``bench.a`` (as the package does) is one cycle, between two files."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "a.py").write_text("from b import B\nA = 1\n")
    (tmp_path / "bench" / "b.py").write_text("def f():\n    from bench.a import A\nB = 2\n")
    (tmp_path / "bench" / "c.py").write_text("import a\n")  # an edge, no cycle
    edges = bench_edges(tmp_path)
    assert {(e.src, e.dst) for e in edges} == {
        ("bench.a", "bench.b"),
        ("bench.b", "bench.a"),
        ("bench.c", "bench.a"),
    }
    cycles = find_cycles(edges)
    assert [sorted(e.src for e in c) for c in cycles] == [["bench.a", "bench.b"]]


def test_no_bench_or_script_module_over_the_limit() -> None:
    files = sorted({p for p in _known().values()})
    assert ROOT / "bench" / "bench_gpu.py" in files
    too_long = {
        p.relative_to(ROOT).as_posix(): n
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, (
        f"modules over {MAX_LINES} lines (split them by responsibility): {too_long}"
    )
