"""kvseal.vllm.compat against the installed vLLM: 0.32 here (``make
test-vllm``); tests_vllm/v033/test_compat.py runs these same tests against
0.33 and 0.34 (``make test-vllm-033`` / ``make test-vllm-034``), plus the
worker's checks. And the device-pointer mapper of vLLM 0.34
(kvseal.vllm.pointers), pure arithmetic.

- Every name in ``compat.NAMES`` that applies to this version is imported and
  checked (a method's parameters, a dataclass field, an attribute ``__init__``
  sets, a property, a name that must be gone): driven by the table itself, so
  a vLLM that renames or re-signs anything kvseal uses fails here.
- The mapper: good pointers map to their pages; a pointer outside a pool, one
  that starts inside a page, a wrong size, layers that disagree all fail.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
from kvseal.vllm import compat
from kvseal.vllm.pointers import PageRegion, PointerError, map_pointers

SUPPORTED = ((0, 32), (0, 33), (0, 34))


def _resolve(name: compat.Name) -> tuple[Any, str]:
    """(the object holding the last part, the last part)."""
    obj: Any = importlib.import_module(name.module)
    *path, last = name.attr.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj, last


def test_compat_names_exist_with_the_expected_signatures() -> None:
    assert compat.VERSION in SUPPORTED, compat.VERSION
    applied = [n for n in compat.NAMES if n.applies(compat.VERSION)]
    # Each (module, attr) is described once per version: no overlapping ranges.
    keys = [(n.module, n.attr) for n in applied]
    assert len(keys) == len(set(keys))
    assert len(applied) >= 25
    wrong: list[str] = []
    for n in applied:
        owner, last = _resolve(n)
        what = f"{n.module}.{n.attr} ({n.kind})"
        if n.kind == "absent":
            if hasattr(owner, last):
                wrong.append(f"{what}: present")
            continue
        if n.kind == "field":
            if last not in getattr(owner, "__dataclass_fields__", {}):
                wrong.append(f"{what}: no such dataclass field")
            continue
        if n.kind == "init":
            src = inspect.getsource(owner.__init__)
            if f"self.{last}" not in src:
                wrong.append(f"{what}: __init__ sets no self.{last}")
            continue
        attr = inspect.getattr_static(owner, last, None)
        if attr is None:
            wrong.append(f"{what}: missing")
        elif n.kind == "property":
            if not isinstance(attr, property):
                wrong.append(f"{what}: not a property")
        elif n.params is not None:
            got = tuple(inspect.signature(getattr(owner, last)).parameters)
            if got != n.params:
                wrong.append(f"{what}: parameters {got}, expected {n.params}")
    assert not wrong, "\n".join(wrong)


def test_version_flags_follow_the_version() -> None:
    v34 = compat.VERSION >= (0, 34)
    assert v34 == compat.DEVICE_POINTERS
    assert v34 == compat.NATIVE_FAILURES
    assert (not v34) == compat.EXPEDITED_LOADS


# ---------------------------------------------------------------- the mapper

# Two groups: group 0 of two layers (pages of 256 bytes in a 256-byte stride),
# group 1 of one layer (100 bytes in a 128-byte stride, padded).
G0 = [PageRegion(0x10000, 256, 8, 256), PageRegion(0x20000, 256, 8, 256)]
G1 = [PageRegion(0x30000, 128, 4, 100)]


def _ptrs(pages0: list[int], pages1: list[int]) -> tuple[list[int], list[int]]:
    ptrs = [r.base + p * r.stride for r in G0 for p in pages0]
    ptrs += [r.base + p * r.stride for r in G1 for p in pages1]
    sizes = [256] * (2 * len(pages0)) + [100] * len(pages1)
    return ptrs, sizes


def test_mapper_maps_good_pointers_to_pages() -> None:
    ptrs, sizes = _ptrs([3, 7, 0], [2])
    pages, gs = map_pointers(ptrs, sizes, (3, 1), (2, 1), [G0, G1])
    assert pages == [3, 7, 0, 2] and gs == [3, 1]
    # An empty group contributes no pointer.
    ptrs, sizes = _ptrs([5], [])
    assert map_pointers(ptrs, sizes, (1, 0), (2, 1), [G0, G1]) == ([5], [1, 0])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("below", "outside"),
        ("beyond", "outside"),
        ("other pool", "outside"),
        ("straddles", "bytes into page"),
        ("size", "size"),
        ("disagree", "other pages"),
        ("short", "pointers expected"),
        ("extra", "beyond"),
    ],
)
def test_mapper_refuses_what_is_not_one_whole_registered_page(case: str, message: str) -> None:
    ptrs, sizes = _ptrs([1, 2], [3])
    counts = (2, 1)
    if case == "below":
        ptrs[0] = G0[0].base - 256
    elif case == "beyond":
        ptrs[1] = G0[0].base + 8 * 256  # page 8 of 8
    elif case == "other pool":
        ptrs[4] = G0[0].base + 3 * 256  # group 1's pointer into group 0's pool
    elif case == "straddles":
        ptrs[0] += 128  # half a page in: would read the next page's first half
    elif case == "size":
        sizes[4] = 128  # group 1's page is 100 bytes (its 128-byte stride is padding)
    elif case == "disagree":
        ptrs[2] = G0[1].base + 5 * 256  # layer 1 of block 0 names page 5, layer 0 page 1
    elif case == "short":
        ptrs, sizes = ptrs[:-1], sizes[:-1]
    elif case == "extra":
        ptrs, sizes = [*ptrs, G1[0].base], [*sizes, 100]
    with pytest.raises(PointerError, match=message):
        map_pointers(ptrs, sizes, counts, (2, 1), [G0, G1])


def test_mapper_refuses_a_layout_it_was_not_registered_with() -> None:
    ptrs, sizes = _ptrs([1], [1])
    with pytest.raises(PointerError, match="data refs"):
        map_pointers(ptrs, sizes, (1, 1), (3, 1), [G0, G1])  # three layers in group 0
    with pytest.raises(PointerError, match="groups"):
        map_pointers(ptrs, sizes, (1,), (2,), [G0, G1])
    with pytest.raises(PointerError, match="sizes"):
        map_pointers(ptrs, sizes[:-1], (1, 1), (2, 1), [G0, G1])
