"""SGLang's device pages and kvseal's staging blocks: the copies between them.

A *component* is one of the pools SGLang 0.5.23's linker wrapper hands a
linker (``PoolName.KV``, ``SWA``, ``MAMBA``; :mod:`kvseal.sglang.pools` reads
them from SGLang's pool classes). Each is a list of *parts*: 2-D byte views
``(rows, row_bytes)`` of SGLang's own tensors, in block order, and each part
holds one page in ``rows_per_page`` consecutive rows:

- a token-row tensor (MHA ``k_buffer``/``v_buffer`` in NHD, MLA ``kv_buffer``,
  per-token scale buffers): ``page_size`` rows, one per token slot;
- a page-row tensor (HND K/V, page-interleaved scales, DSA indexer keys): one
  row per page;
- a state tensor (a Mamba layer's temporal or conv state): one row per state
  slot, and a "page" is one state (one device index per page).

A staging block is one page of every part, concatenated in part order: for
MHA, layer by layer K then V (then K scales, V scales: a quantized pool's
scales are segments of the same block, sealed and verified with it); for MLA,
each layer's latent row (and scales, DSA indexer keys); for Mamba, each
layer's temporal then conv states.

kvseal does not hand SGLang's own tensors to the daemon: it copies each page
into a staging block the linker owns (:class:`PageCopier`), and the daemon
seals from and opens into staging. Why a copy:

- the daemon sees one layout whatever SGLang allocates (fused K/V halves, HND
  pages, state slots), and the namespace (hence block identity) depends only
  on the component's page geometry;
- a restore reaches SGLang's pool only after *every* block of a chunk
  verified (the scatter runs after the daemon's reply), so a failed restore
  writes nothing of that chunk into SGLang's pages;
- the copy is a memcpy (CPU) or a device-to-device copy (GPU): cheap next to
  AES-GCM, see docs/sglang.md.

Nothing here imports SGLang: :class:`PageCopier` takes the tensors, so the
copies are tested on their own (tests_sglang/test_layout.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The staging layout names (PoolGeometry.layout: part of kvseal's namespace).
# MHA NHD keeps the first version's name, so its blocks keep their namespace.
LAYOUT_MHA = "sglang-page:v1"
LAYOUT_MHA_HND = "sglang-page:v1/hnd"  # head-major page bytes: not NHD's blocks
LAYOUT_MLA = "sglang-mla:v1"
LAYOUT_MAMBA = "sglang-mamba-state:v1"


@dataclass(frozen=True)
class PageGeometry:
    """What one page (block) of a component is: the staging block's layout and
    the fields kvseal's namespace and fingerprint are derived from."""

    page_size: int  # tokens per page (1 for a state: one state per "page")
    num_layers: int
    heads: int  # MHA: KV heads; MLA: 1; Mamba: 0
    head_dim: int  # MHA: K head dim; MLA: the latent's width; Mamba: 0
    v_head_dim: int
    dtype: str  # the pool's dtype (fp8 pools: the fp8 dtype, not their uint8 storage)
    itemsize: int
    hnd: bool
    part_bytes: tuple[int, ...] = ()  # one page's bytes of each part, in block order
    component: str = "kv"  # SGLang's pool name: kv, swa, mamba
    kind: str = "mha"  # mha | mla | mamba
    indices_per_page: int = 0  # device indices per page (0: page_size)
    scaled: bool = False  # scale (or indexer) parts follow the data parts
    layout: str = LAYOUT_MHA

    @property
    def k_bytes(self) -> int:
        """One layer's K bytes of one page (MHA)."""
        return self.page_size * self.heads * self.head_dim * self.itemsize

    @property
    def v_bytes(self) -> int:
        return self.page_size * self.heads * self.v_head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """One staging block: one page of every part."""
        if self.part_bytes:
            return sum(self.part_bytes)
        return self.num_layers * (self.k_bytes + self.v_bytes)

    @property
    def ipp(self) -> int:
        return self.indices_per_page or self.page_size


@dataclass(frozen=True)
class Part:
    """One tensor's share of a page: ``rows`` is a uint8 ``(R, row_bytes)``
    view of SGLang's tensor (no copy), a page is ``rows_per_page`` rows."""

    rows: Any
    rows_per_page: int

    @property
    def page_bytes(self) -> int:
        return int(self.rows.shape[1]) * self.rows_per_page


def byte_rows(t: Any) -> Any:
    """A uint8 ``(rows, row_bytes)`` view of a tensor whose first dimension is
    its row; ValueError when its rows are not one contiguous run each."""
    import torch  # noqa: PLC0415 - only an engine process gets here

    if t.dim() < 1 or not t.is_contiguous():
        raise ValueError(f"a tensor of shape {tuple(t.shape)} is not contiguous rows")
    flat = t.reshape(t.shape[0], -1) if t.dim() == 1 else t.view(t.shape[0], -1)
    return flat.view(torch.uint8)


def token_part(t: Any, token_rows: int, page_size: int, what: str) -> Part:
    """The part of a tensor indexed by token slot (``token_rows`` rows) or by
    page (``token_rows / page_size`` rows); ValueError for anything else."""
    rows = byte_rows(t)
    n = int(rows.shape[0])
    if n == token_rows:
        return Part(rows, page_size)
    if n * page_size == token_rows:
        return Part(rows, 1)
    raise ValueError(
        f"{what}: {n} rows fit neither {token_rows} token slots nor their "
        f"{token_rows // page_size} pages of {page_size}"
    )


class PageCopier:
    """Copies whole pages between SGLang's tensors (the parts) and staging
    blocks (module doc). The caller owns both sides: it must keep SGLang's
    pages from being freed or rewritten during a gather (SGLang's offload
    lock) and from being read during a scatter (the pages are private to the
    loading request until its forward). Each call only reads its inputs and
    writes its outputs.

    Built either from MHA ``k``/``v`` lists (the first version's signature:
    NHD or HND pages, layer by layer K then V) or from ``parts``."""

    def __init__(
        self,
        k: Sequence[Any] | None,
        v: Sequence[Any] | None,
        geometry: PageGeometry,
        parts: Sequence[Part] | None = None,
    ) -> None:
        import torch  # noqa: PLC0415

        self.g = geometry
        self._torch = torch
        if parts is None:
            assert k is not None and v is not None
            rpp = 1 if geometry.hnd else geometry.page_size
            parts = [Part(byte_rows(t), rpp) for pair in zip(k, v, strict=True) for t in pair]
        self.parts = list(parts)
        self._offsets: list[int] = []
        off = 0
        for p in self.parts:
            self._offsets.append(off)
            off += p.page_bytes
        if off != geometry.block_bytes:
            raise ValueError(f"parts of {off} bytes per page, geometry {geometry.block_bytes}")

    def _pages(self, indices: Any) -> tuple[Any, Any, int]:
        """(device indices as int64, page numbers, pages) of page-aligned indices."""
        ipp = self.g.ipp
        n = int(indices.numel())
        if n % ipp:
            raise ValueError(f"{n} device indices is not a whole number of {ipp}-index pages")
        idx = indices.to(dtype=self._torch.int64, device=self.parts[0].rows.device).flatten()
        pages = idx[::ipp] // ipp if ipp > 1 else idx
        return idx, pages, n // ipp

    def _rows(self, part: Part, idx: Any, pages: Any) -> Any:
        rpp = part.rows_per_page
        if rpp == self.g.ipp:
            return idx  # one row per device index: the indices are the rows
        if rpp == 1:
            return pages
        step = self._torch.arange(rpp, dtype=self._torch.int64, device=pages.device)
        return (pages[:, None] * rpp + step).flatten()

    def gather(self, indices: Any, staging: Any, slots: Any) -> None:
        """Copy the pages at ``indices`` (page-aligned device indices, in page
        order) into staging rows ``slots`` (``staging``: uint8
        ``(blocks, block_bytes)``; ``slots``: one int64 per page)."""
        idx, pages, n = self._pages(indices)
        if n == 0:
            return
        for part, off in zip(self.parts, self._offsets, strict=True):
            data = part.rows.index_select(0, self._rows(part, idx, pages))
            staging[slots, off : off + part.page_bytes] = data.reshape(n, part.page_bytes)

    def scatter(self, staging: Any, slots: Any, indices: Any) -> None:
        """Copy staging rows ``slots`` into the pages at ``indices`` (the
        inverse of :meth:`gather`)."""
        idx, pages, n = self._pages(indices)
        if n == 0:
            return
        blocks = staging.index_select(0, slots)
        for part, off in zip(self.parts, self._offsets, strict=True):
            src = blocks[:, off : off + part.page_bytes].reshape(-1, part.rows.shape[1])
            part.rows.index_copy_(0, self._rows(part, idx, pages), src)


def geometry_of(kvcache: Any, page_size: int) -> PageGeometry:
    """The page geometry of an SGLang MHA KV pool (unquantized or fp8 without
    scale buffers, NHD or HND pages), or ValueError saying why not. Pools of
    other kinds go through :func:`kvseal.sglang.pools.components`."""
    k = getattr(kvcache, "k_buffer", None)
    v = getattr(kvcache, "v_buffer", None)
    if not isinstance(k, list) or not isinstance(v, list) or not k or len(k) != len(v):
        raise ValueError(
            f"kvseal stores MHA KV pools (per-layer k_buffer/v_buffer) here; "
            f"{type(kvcache).__name__} is not one"
        )
    if getattr(kvcache, "k_scale_buffer", None) is not None:
        raise ValueError("an MHA pool with scale buffers: use kvseal.sglang.pools")
    if getattr(kvcache, "kv_cache_layout", None) == "vectorized_5d":
        raise ValueError(
            "kvseal does not store the vectorized_5d KV layout (ROCm AITER only: "
            "a page's bytes are not one run per tensor)"
        )
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
    # fp8 pools keep fp8 in uint8 storage: the pool's dtype names the bytes.
    dtype = getattr(kvcache, "dtype", None) or k0.dtype
    return PageGeometry(
        page_size=page_size,
        num_layers=len(k),
        heads=int(heads),
        head_dim=int(head_dim),
        v_head_dim=int(v_head_dim),
        dtype=str(dtype).removeprefix("torch."),
        itemsize=int(k0.element_size()),
        hnd=hnd,
        layout=LAYOUT_MHA_HND if hnd else LAYOUT_MHA,
    )
