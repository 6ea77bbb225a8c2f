"""Both backends satisfy the one interface (``kvseal.server.backends.base``).

The cache only ever talks to a :class:`~kvseal.server.backends.base.Backend`
and a :class:`~kvseal.server.backends.base.Region`; the backends hand it their
own pool mappings (:class:`~kvseal.server.pools.MappedPool`). Here every member
of those protocols is checked on both twins: present, and for methods the same
parameters (names, kinds, defaults, resolved annotations) and a return type that
is the protocol's or the twin's own implementation of it. mypy checks the same
structurally where the daemon builds a backend (``make_backend``); this test
also names what is missing or different. The CUDA side runs on the CPU over the
emulated device, as tests/test_cuda_backend_cpu.py does.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvseal.server.backends import base
from kvseal.server.backends.base import Backend, Region
from kvseal.server.backends.cpu.backend import CpuBackend, CpuMappedPool
from kvseal.server.backends.cuda import emulated as E
from kvseal.server.backends.cuda.backend import CudaBackend
from kvseal.server.backends.cuda.ipc import CudaMappedPool
from kvseal.server.backends.cuda.region import CudaHostRegion
from kvseal.server.hostregion import HostRegion
from kvseal.server.pools import MappedPool
from kvseal.server.sealing import BlockSealer

ROOT = Path(__file__).resolve().parents[1]

# (protocol, the CPU twin, the CUDA twin)
TWINS: list[tuple[type[Any], type[Any], type[Any]]] = [
    (Backend, CpuBackend, CudaBackend),
    (Region, HostRegion, CudaHostRegion),
    (MappedPool, CpuMappedPool, CudaMappedPool),
]
# A method may promise more than the protocol: its backend's own implementation.
NARROWER = {proto: {cpu, cuda} for proto, cpu, cuda in TWINS}


def protocol_members(proto: type[Any]) -> tuple[dict[str, Any], set[str]]:
    """(methods by name, data attribute names) the protocol declares itself."""
    methods = {
        n: v for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")
    }
    data = set(vars(proto).get("__annotations__", {}))
    return methods, data


def signature_problems(proto: type[Any], cls: type[Any]) -> Iterator[str]:
    methods, data = protocol_members(proto)
    for name, want in sorted(methods.items()):
        got = getattr(cls, name, None)
        if got is None or not callable(got):
            yield f"{cls.__name__}.{name} is missing"
            continue
        ws, gs = inspect.signature(want), inspect.signature(got)
        shape = [(p.name, p.kind, p.default) for p in ws.parameters.values()]
        if shape != [(p.name, p.kind, p.default) for p in gs.parameters.values()]:
            yield f"{cls.__name__}.{name}{gs} differs from the interface's {name}{ws}"
            continue
        wh, gh = typing.get_type_hints(want), typing.get_type_hints(got)
        for p in ws.parameters:
            if p != "self" and wh.get(p) != gh.get(p):
                yield f"{cls.__name__}.{name}: {p} is {gh.get(p)}, the interface says {wh.get(p)}"
        ret_w, ret_g = wh.get("return"), gh.get("return")
        if ret_g != ret_w and ret_g not in NARROWER.get(ret_w, set()):
            yield f"{cls.__name__}.{name} returns {ret_g}, the interface says {ret_w}"
    for name in sorted(data):
        # Data members may be set per instance (checked on instances below);
        # a class-level one must at least not be a method.
        if inspect.isfunction(getattr(cls, name, None)):
            yield f"{cls.__name__}.{name} is a method; the interface declares data"


@pytest.mark.parametrize(
    ("proto", "cls"),
    [(p, c) for p, cpu, cuda in TWINS for c in (cpu, cuda)],
    ids=lambda x: x.__name__,
)
def test_twin_has_the_interfaces_methods_and_signatures(proto: type[Any], cls: type[Any]) -> None:
    problems = list(signature_problems(proto, cls))
    assert not problems, "\n".join(problems)


def test_the_checker_notices_a_wrong_signature() -> None:
    class Wrong:
        kind = "x"

        def make_region(self, capacity: int) -> Region:  # no path
            raise NotImplementedError

        def map_pool(self, spec: str) -> MappedPool:  # wrong type
            raise NotImplementedError

    problems = list(signature_problems(Backend, Wrong))
    assert any("make_region" in p and "differs" in p for p in problems)
    assert any("map_pool: spec" in p for p in problems)
    assert any("seal_blocks is missing" in p for p in problems)


def test_interface_is_what_the_cache_uses() -> None:
    """The cache reaches the backend only through the interface's members."""
    import ast

    methods, data = protocol_members(Backend)
    allowed = set(methods) | data
    used: set[str] = set()
    for path in (ROOT / "server" / "kvseal" / "server" / "cache").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "backend"
            ):
                used.add(node.attr)
    assert used, "the cache no longer calls its backend?"
    assert used <= allowed, f"the cache uses {sorted(used - allowed)} outside the interface"


@pytest.fixture(scope="module")
def emu() -> E.Emulator:
    try:
        return E.load_emulator()
    except E.EmulatorUnavailable as exc:
        pytest.skip(f"CPU emulator unavailable: {exc}")


def test_instances_satisfy_the_runtime_checkable_protocols(emu: E.Emulator) -> None:
    from kvseal.server.backends.cuda.emulated_device import EmulatedDevice

    sealer = BlockSealer()
    cpu = CpuBackend(sealer, 1)
    cuda = CudaBackend(sealer, 0, dev=EmulatedDevice(), cc="off")
    regions = [cpu.make_region(1 << 16, None), cuda.make_region(1 << 16, None)]
    try:
        for backend, kind in ((cpu, "cpu"), (cuda, "cuda")):
            assert isinstance(backend, Backend)
            assert backend.kind == kind and type(backend).kind == kind
            hints = typing.get_type_hints(Backend)
            for name in protocol_members(Backend)[1]:
                assert isinstance(getattr(backend, name), hints[name]), name
        for region in regions:
            assert isinstance(region, Region)
            assert region.capacity == 1 << 16 and isinstance(region.description, str)
    finally:
        for r in regions:
            r.close()
        cpu.close()
        cuda.close()
        sealer.close()


def test_both_backends_have_the_same_shape() -> None:
    """``backends/<kind>/backend.py`` holds ``<Kind>Backend`` (``kind == "<kind>"``)
    and the pool mapping it hands the cache, ``<Kind>MappedPool``."""
    import importlib

    for kind in ("cpu", "cuda"):
        assert (Path(base.__file__).parent / kind / "backend.py").is_file()
        mod = importlib.import_module(f"kvseal.server.backends.{kind}.backend")
        cls = getattr(mod, f"{kind.capitalize()}Backend")
        assert cls.kind == kind
        pool = inspect.signature(cls.map_pool).return_annotation
        assert pool == f"{kind.capitalize()}MappedPool", pool


def test_cuda_backend_imports_without_cuda_python() -> None:
    """Importing the CUDA backend (all its modules) loads neither cuda-python nor
    torch: the daemon and this suite import it on machines without a GPU."""
    code = (
        "import sys\n"
        "import kvseal.server.backends.cuda.backend, kvseal.server.backends.cuda.emulated_device\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('cuda', 'torch')]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
