"""SGLang's KV pages and kvseal's staging blocks: the copies between them.

SGLang keeps one K and one V tensor per layer (``MHATokenToKVPool.k_buffer`` /
``v_buffer``), in one of its layouts:

- **NHD** (the default): ``(rows, heads, head_dim)``, one row per token slot; a
  page of ``page_size`` tokens is ``page_size`` consecutive rows starting at a
  multiple of ``page_size``;
- **HND** (``SGLANG_USE_HND_KVCACHE``): ``(pages, heads, page_size, head_dim)``,
  one page per first index.

Either way a page's bytes within one layer's K (or V) tensor are one contiguous
run. kvseal does not hand SGLang's own tensors to the daemon: it copies each
page into a *staging block* the linker owns (:class:`PageCopier`), in one
fixed layout, and the daemon seals from and opens into staging. Why a copy:

- the daemon sees one layout whatever SGLang allocates (its fused K/V halves,
  HND pages, later layouts), and the namespace (hence block identity) depends
  only on the model's page geometry;
- a restore reaches SGLang's pool only after *every* block of it verified
  (the scatter runs after the daemon's reply), so a failed restore writes
  nothing into SGLang's pages, not even a verified prefix;
- the copy is a memcpy (CPU) or a device-to-device copy (GPU): cheap next to
  AES-GCM, see docs/sglang.md.

A staging block is, layer by layer in SGLang's layer order, the page's K bytes
then its V bytes (``page_size x heads x head_dim x itemsize`` each).

Nothing here imports SGLang: :class:`PageCopier` takes the tensors, so the
copies are tested on their own (tests_sglang/test_layout.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PageGeometry:
    """What one page of the pool is: the staging block's layout and the fields
    kvseal's namespace is derived from."""

    page_size: int  # tokens per page
    num_layers: int
    heads: int
    head_dim: int
    v_head_dim: int
    dtype: str  # torch dtype name without "torch."
    itemsize: int
    hnd: bool

    @property
    def k_bytes(self) -> int:
        """One layer's K bytes of one page."""
        return self.page_size * self.heads * self.head_dim * self.itemsize

    @property
    def v_bytes(self) -> int:
        return self.page_size * self.heads * self.v_head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """One staging block: every layer's K and V bytes of one page."""
        return self.num_layers * (self.k_bytes + self.v_bytes)


def geometry_of(kvcache: Any, page_size: int) -> PageGeometry:
    """The page geometry of an SGLang KV pool, or ValueError saying why kvseal
    cannot store it (only MHA pools with unquantized NHD or HND pages are
    supported; MLA, FP4/FP8-with-scales and vectorized layouts are refused)."""
    k = getattr(kvcache, "k_buffer", None)
    v = getattr(kvcache, "v_buffer", None)
    if not isinstance(k, list) or not isinstance(v, list) or not k or len(k) != len(v):
        raise ValueError(
            f"kvseal stores MHA KV pools (per-layer k_buffer/v_buffer); "
            f"{type(kvcache).__name__} is not one (MLA and hybrid pools are not supported)"
        )
    if getattr(kvcache, "k_scale_buffer", None) is not None:
        raise ValueError("kvseal does not store quantized KV pools with scale buffers")
    if getattr(kvcache, "kv_cache_layout", None) == "vectorized_5d":
        raise ValueError("kvseal does not store the vectorized_5d KV layout")
    if page_size < 1:
        raise ValueError(f"page size {page_size}")
    hnd = bool(getattr(kvcache, "use_hnd", False))
    k0, v0 = k[0], v[0]
    if hnd:
        if k0.dim() != 4 or k0.shape[2] != page_size:
            raise ValueError(f"HND K buffer of shape {tuple(k0.shape)}, page size {page_size}")
        heads, head_dim, v_head_dim = k0.shape[1], k0.shape[3], v0.shape[3]
    else:
        if k0.dim() != 3 or v0.dim() != 3:
            raise ValueError(f"NHD K/V buffers of shapes {tuple(k0.shape)}, {tuple(v0.shape)}")
        heads, head_dim, v_head_dim = k0.shape[1], k0.shape[2], v0.shape[2]
    for i, (kt, vt) in enumerate(zip(k, v, strict=True)):
        if kt.shape != k0.shape or vt.shape != v0.shape or kt.dtype != k0.dtype:
            raise ValueError(f"layer {i}: K/V buffers differ from layer 0's")
        if not kt.is_contiguous() or not vt.is_contiguous():
            raise ValueError(f"layer {i}: K/V buffers are not contiguous")
    return PageGeometry(
        page_size=page_size,
        num_layers=len(k),
        heads=int(heads),
        head_dim=int(head_dim),
        v_head_dim=int(v_head_dim),
        dtype=str(k0.dtype).removeprefix("torch."),
        itemsize=int(k0.element_size()),
        hnd=hnd,
    )


class PageCopier:
    """Copies whole pages between SGLang's per-layer K/V tensors and staging
    blocks (module doc). The caller owns both sides: it must keep SGLang's
    pages from being freed or rewritten during a gather (SGLang's offload
    lock) and from being read during a scatter (the pages are private to the
    loading request until its forward). Not thread-safe per call site: each
    call only reads its inputs and writes its outputs."""

    def __init__(self, k: Sequence[Any], v: Sequence[Any], geometry: PageGeometry) -> None:
        import torch  # noqa: PLC0415 - only an engine process gets here

        self.g = geometry
        self._int64 = torch.int64
        # One byte-row view per layer and K/V: row = one token slot (NHD) or one
        # page (HND), so pages are selected with one index per row.
        self._rows: list[Any] = []
        for t in [x for pair in zip(k, v, strict=True) for x in pair]:
            flat = t.view(t.shape[0], -1)
            self._rows.append(flat.view(torch.uint8) if flat.element_size() != 1 else flat)
        offs = []
        off = 0
        for _ in range(geometry.num_layers):
            offs.append((off, off + geometry.k_bytes))
            off += geometry.k_bytes + geometry.v_bytes
        self._offsets = offs

    def _rows_of(self, token_indices: Any) -> tuple[Any, int]:
        """(row index tensor, pages) of page-aligned token slot indices."""
        ps = self.g.page_size
        n = int(token_indices.numel())
        if n % ps:
            raise ValueError(f"{n} token slots is not a whole number of {ps}-token pages")
        idx = token_indices.to(dtype=self._int64, device=self._rows[0].device)
        if self.g.hnd:
            return idx[::ps] // ps, n // ps
        return idx, n // ps

    def gather(self, token_indices: Any, staging: Any, slots: Any) -> None:
        """Copy the pages at ``token_indices`` (page-aligned token slots, in
        page order) into staging rows ``slots`` (``staging``: uint8
        ``(blocks, block_bytes)``; ``slots``: one int64 per page)."""
        rows, pages = self._rows_of(token_indices)
        if pages == 0:
            return
        kb, vb = self.g.k_bytes, self.g.v_bytes
        for layer, (ko, vo) in enumerate(self._offsets):
            kr, vr = self._rows[2 * layer], self._rows[2 * layer + 1]
            k = kr.index_select(0, rows).reshape(pages, kb)
            v = vr.index_select(0, rows).reshape(pages, vb)
            staging[slots, ko : ko + kb] = k
            staging[slots, vo : vo + vb] = v

    def scatter(self, staging: Any, slots: Any, token_indices: Any) -> None:
        """Copy staging rows ``slots`` into the pages at ``token_indices``
        (the inverse of :meth:`gather`)."""
        rows, pages = self._rows_of(token_indices)
        if pages == 0:
            return
        row_bytes_k = self._rows[0].shape[1]
        row_bytes_v = self._rows[1].shape[1]
        blocks = staging.index_select(0, slots)
        for layer, (ko, vo) in enumerate(self._offsets):
            kr, vr = self._rows[2 * layer], self._rows[2 * layer + 1]
            k = blocks[:, ko : ko + self.g.k_bytes].reshape(-1, row_bytes_k)
            v = blocks[:, vo : vo + self.g.v_bytes].reshape(-1, row_bytes_v)
            kr.index_copy_(0, rows, k)
            vr.index_copy_(0, rows, v)
