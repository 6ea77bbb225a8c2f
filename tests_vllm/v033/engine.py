"""vLLM 0.33's own scheduler and worker-side connector, driven without a model.

:class:`Engine` builds what a vLLM 0.33 engine builds around kvseal, from the
0.33 wheel's own code: the ``VllmConfig`` (a local config.json, no weights, no
tokenizer), a ``KVCacheConfig`` of one full-attention group (or, with
``hybrid``, several groups as vLLM 0.33's own planner builds them for a hybrid
model: see :data:`HYBRID_KINDS`), vLLM's real
``Scheduler`` (which creates kvseal's connector in the scheduler role through
vLLM's connector factory: vLLM's ``OffloadingConnectorScheduler`` with
kvseal's manager), and the connector in the worker role (vLLM's
``OffloadingConnectorWorker`` with kvseal's worker) over a KV cache in shared
memory, as the connector makes vLLM allocate it on the CPU platform.

:meth:`Engine.step` plays the model runner: it calls the worker-side
connector hooks in the order vLLM 0.33's ``KVConnectorModelRunnerMixin`` does,
writes each scheduled request's computed KV pages (bytes derived from the
request's tokens, so a restore can be checked byte for byte), samples one token
and hands the connector's output back to the scheduler. Everything else is
vLLM's and kvseal's: lookups, the manager lock, sync (expedited) and async
loads, stores, resets, stats.

A hybrid engine (``Engine(..., hybrid="swa")`` or ``"mamba"``) is planned by
vLLM 0.33's engine-core code path itself: per-layer specs, then
``get_global_kv_cache_groups`` / ``get_kv_cache_configs`` /
``generate_scheduler_kv_cache_config`` (the hybrid allocator: groups of the
same number of layers, their ``KVCacheTensor`` s aliasing one backing
allocation from byte 0, a block id owned by one group at a time), and its KV
cache is allocated by the worker's own ``allocate_kv_cache``. The fake forward
pass then writes every group's pages, and performs the scheduler's block
copies (Mamba ``align`` mode's copy-on-write), as the model runner does.

Nothing here needs CUDA: vLLM 0.33's compiled extensions (``vllm._C_stable_libtorch``,
``vllm._moe_C_stable_libtorch``, ``vllm.cumem_allocator``: libcuda; ``vllm.fs_io_C``:
libnvrtc) are never imported by this path.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvseal.core import shm_kv
from kvseal.vllm.spec import KVSealOffloadingManager, KVSealOffloadingWorker
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16  # tokens per block
LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 32
NUM_BLOCKS = 48
DTYPE = torch.bfloat16
# One block of one layer: K and V, BLOCK tokens, KV_HEADS heads, HEAD_DIM, bf16.
PAGE = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

# The hybrid engines (``Engine(hybrid=...)``): four layers, the even ones full
# attention, the odd ones the second kind, 32-token blocks (vLLM's hybrid
# planner groups them two by two: group 0 full attention, group 1 the other).
HBLOCK = 32
HLAYERS = 4
HNUM_BLOCKS = 64
HMAX_LEN = 512
WINDOW = 64  # tokens: two blocks
HPAGE = 2 * HBLOCK * KV_HEADS * HEAD_DIM * 2  # one attention layer's block, bf16
HLAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(HLAYERS)]
# A Mamba-2-like state (conv, ssm): 4864 real bytes, padded by vLLM's planner to
# the attention page.
MAMBA_SHAPES = ((3, 128), (2, 16, 32))
MAMBA_DTYPES = (torch.bfloat16, torch.float32)
HYBRID_KINDS = ("swa", "mamba")
# Hybrids vLLM 0.33 selects for offloading but kvseal refuses at start (with the
# reason): Mamba state outside align mode, chunked local attention.
REFUSED_KINDS = ("mamba-none", "chunked")


def hybrid_layer_specs(kind: str) -> dict[str, KVCacheSpec]:
    """Each layer's spec, as the model runner reports them to the engine core."""
    attn = dict(block_size=HBLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=DTYPE)
    other: KVCacheSpec
    if kind == "swa":
        other = SlidingWindowSpec(sliding_window=WINDOW, **attn)  # type: ignore[arg-type]
    elif kind in ("mamba", "mamba-none"):
        other = MambaSpec(
            block_size=HBLOCK,
            shapes=MAMBA_SHAPES,
            dtypes=MAMBA_DTYPES,
            mamba_cache_mode="align" if kind == "mamba" else "none",
        )
    elif kind == "chunked":
        other = ChunkedLocalAttentionSpec(attention_chunk_size=WINDOW, **attn)  # type: ignore[arg-type]
    else:
        raise ValueError(f"hybrid kind {kind!r}: one of {HYBRID_KINDS + REFUSED_KINDS}")
    full = FullAttentionSpec(**attn)  # type: ignore[arg-type]
    return {n: (full if i % 2 == 0 else other) for i, n in enumerate(HLAYER_NAMES)}


def state_bytes(prefix: list[int], group: int, layer: int, nbytes: int) -> bytes:
    """What the fake forward pass writes into one layer's page of ``group`` for
    the tokens ``prefix`` (an attention block: the block's whole prefix; a
    Mamba state: every token it has consumed), ``nbytes`` long."""
    seed = hashlib.sha256(repr(prefix).encode() + bytes([group, layer])).digest()
    out = bytearray()
    while len(out) < nbytes:
        seed = hashlib.sha256(seed).digest()
        out += seed
    return bytes(out[:nbytes])


def write_model_config(path: Path) -> Path:
    """A Llama config.json (no weights: the scheduler never loads a model)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": KV_HEADS * HEAD_DIM * 2,
        "intermediate_size": 256,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": KV_HEADS * 2,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def page_bytes(tokens: list[int], block: int, layer: int) -> bytes:
    """The KV bytes the fake forward pass writes for ``block`` (index in the
    request) of a request with ``tokens``: a function of the block's whole
    prefix, as real KV is."""
    prefix = repr(tokens[: (block + 1) * BLOCK]).encode()
    seed = hashlib.sha256(prefix + bytes([layer])).digest()
    out = bytearray()
    while len(out) < PAGE:
        seed = hashlib.sha256(seed).digest()
        out += seed
    return bytes(out[:PAGE])


@dataclass
class Engine:
    """vLLM 0.33's scheduler and worker-side connector around kvseal (module doc)."""

    model: Path
    socket: str
    extra: dict[str, Any] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)  # EngineCoreOutputs per step
    last_blocks: dict[str, list[int]] = field(default_factory=dict)  # see block_ids
    # "": one full-attention group (the default). "swa" / "mamba": full
    # attention plus a sliding-window / Mamba (align) group (HYBRID_KINDS).
    hybrid: str = ""
    # Hybrid: per request, every group's block ids in its last step (see group_block_ids).
    last_group_blocks: dict[str, list[list[int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hybrid:
            self._init_hybrid()
            return
        hash_algo = "sha256"
        mc = ModelConfig(
            model=str(self.model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024
        )
        self.vllm_config = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(
                block_size=BLOCK,
                enable_prefix_caching=True,
                prefix_caching_hash_algo=hash_algo,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=1024,
                max_num_seqs=8,
                max_model_len=1024,
                is_encoder_decoder=False,
            ),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVSealOffloadingConnector",
                kv_connector_module_path="kvseal.vllm.connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={"kvseal_socket": self.socket, **self.extra},
            ),
        )
        self.vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=DTYPE
        )
        assert spec.page_size_bytes == PAGE
        self.kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=PAGE * NUM_BLOCKS * LAYERS,
                    layers=list(LAYER_NAMES),
                    layer_stride=PAGE * NUM_BLOCKS,
                    block_stride=PAGE,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)],
        )
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(self.hash_fn)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK,
        )
        # The worker role, as the model runner builds it (here in-process).
        from kvseal.vllm.connector import KVSealOffloadingConnector

        self.worker_connector = KVSealOffloadingConnector(
            self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        with shm_kv.shm_kv_allocation():
            self.buf = torch.zeros(PAGE * NUM_BLOCKS * LAYERS, dtype=torch.int8)
        # vLLM's attention layout per layer: (num_blocks, 2, BLOCK, heads, dim).
        self.kv_caches = {
            name: self.buf[i * PAGE * NUM_BLOCKS : (i + 1) * PAGE * NUM_BLOCKS]
            .view(DTYPE)
            .view(NUM_BLOCKS, 2, BLOCK, KV_HEADS, HEAD_DIM)
            for i, name in enumerate(LAYER_NAMES)
        }
        self.worker_connector.register_kv_caches(self.kv_caches)

    def _init_hybrid(self) -> None:
        """A hybrid engine, planned and allocated by vLLM 0.33's own code, in
        the order its engine core runs it (``EngineCore._initialize_kv_caches``)."""
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.worker.utils import allocate_kv_cache

        hash_algo = "sha256"
        mc = ModelConfig(
            model=str(self.model),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=HMAX_LEN,
        )
        vc = self.vllm_config = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(
                block_size=HBLOCK,
                enable_prefix_caching=True,
                prefix_caching_hash_algo=hash_algo,
                num_gpu_blocks_override=HNUM_BLOCKS,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=1024,
                max_num_seqs=8,
                max_model_len=HMAX_LEN,
                is_encoder_decoder=False,
            ),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVSealOffloadingConnector",
                kv_connector_module_path="kvseal.vllm.connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={"kvseal_socket": self.socket, **self.extra},
            ),
        )
        # What a GPU or CPU platform resolves: the hybrid allocator on (the connector
        # supports it, SupportsHMA). This process has no platform, for which
        # vLLM turns it off and would fold the window into full attention.
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        if self.hybrid == "mamba":
            vc.cache_config.mamba_cache_mode = "align"
        specs = hybrid_layer_specs(self.hybrid)
        # LBNHC: the layer-outermost layout vLLM's attention backends prefer.
        layout = resolve_kv_cache_layout(vc, [["LBNHC"]], specs.values())
        groups = get_global_kv_cache_groups(vc, [specs])
        (cfg,) = get_kv_cache_configs(vc, [specs], [1 << 30], groups)
        cfg.kv_cache_layout = vc.cache_config.kv_cache_layout
        sched_cfg = generate_scheduler_kv_cache_config([cfg])
        vc.cache_config.num_gpu_blocks = sched_cfg.num_blocks
        vc.cache_config.block_size = min(
            g.kv_cache_spec.block_size
            for g in sched_cfg.kv_cache_groups
            if g.kv_cache_spec.prefix_cacheable
        )
        block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_cfg, vc)
        align = resolve_cache_hit_alignment_tokens(sched_cfg, vc, block_size, hash_block_size)
        for c in (cfg, sched_cfg):
            c.hash_block_size = hash_block_size
            c.cache_hit_alignment_tokens = align
        self.kv_cache_config = cfg
        self.hash_block_size = hash_block_size
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(self.hash_fn)
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=sched_cfg,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        from kvseal.vllm.connector import KVSealOffloadingConnector

        self.worker_connector = KVSealOffloadingConnector(vc, KVConnectorRole.WORKER, cfg)
        with shm_kv.shm_kv_allocation():
            self.kv_caches = allocate_kv_cache(cfg, torch.device("cpu"), layout)
        first = next(iter(self.kv_caches.values()))
        size = cfg.kv_cache_tensors[0].size
        self.buf = torch.tensor([], dtype=torch.int8).set_(first.untyped_storage(), 0, (size,))
        # (group, layer in group) -> (offset of block 0, block stride, real page bytes)
        self.slots: dict[tuple[int, int], tuple[int, int, int]] = {}
        for gi, g in enumerate(cfg.kv_cache_groups):
            spec = g.kv_cache_spec
            real = spec.real_page_size_bytes
            for li, name in enumerate(g.layer_names):
                t = next(t for t in cfg.kv_cache_tensors if name in t.layers)
                off = t.offset + t.layers.index(name) * t.layer_stride
                self.slots[(gi, li)] = (off, t.block_stride, real)
        self.worker_connector.register_kv_caches(self.kv_caches)

    # ------------------------------------------------------------ parts

    @property
    def manager(self) -> KVSealOffloadingManager:
        conn = self.scheduler.connector
        assert conn is not None
        mgr = conn.connector_scheduler.manager  # type: ignore[attr-defined]
        assert isinstance(mgr, KVSealOffloadingManager)
        return mgr

    @property
    def worker(self) -> KVSealOffloadingWorker:
        cw = self.worker_connector.connector_worker
        assert cw is not None and isinstance(cw.worker, KVSealOffloadingWorker)
        return cw.worker

    def page(self, block_id: int, layer: int, group: int = 0) -> bytes:
        """One layer's page of ``block_id`` (hybrid: ``layer`` within ``group``,
        its real bytes, padding excluded)."""
        if not self.hybrid:
            off = layer * PAGE * NUM_BLOCKS + block_id * PAGE
            return bytes(self.buf[off : off + PAGE].numpy().tobytes())
        base, stride, n = self.slots[(group, layer)]
        off = base + block_id * stride
        return bytes(self.buf[off : off + n].numpy().tobytes())

    def _write(self, group: int, layer: int, block_id: int, data: bytes) -> None:
        base, stride, n = self.slots[(group, layer)]
        assert len(data) == n
        off = base + block_id * stride
        self.buf[off : off + n] = torch.frombuffer(bytearray(data), dtype=torch.int8)

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_config.kv_cache_groups)

    def expected_page(self, tokens: list[int], group: int, layer: int, end: int) -> bytes:
        """What the fake forward pass writes, for a request of ``tokens``, into
        the page of ``group`` holding tokens up to ``end`` (a hybrid engine)."""
        n = self.slots[(group, layer)][2]
        return state_bytes(tokens[:end], group, layer, n)

    def group_block_ids(self, req_id: str) -> list[list[int]]:
        """Every group's block ids of the request (0: vLLM's null block, e.g. a
        sliding-window block out of the window), as in :meth:`block_ids`."""
        if req_id in self.scheduler.requests:
            self.last_group_blocks[req_id] = [
                list(b) for b in self.scheduler.kv_cache_manager.get_block_ids(req_id)
            ]
        return self.last_group_blocks[req_id]

    def block_ids(self, req_id: str) -> list[int]:
        """The request's KV blocks (group 0), as the scheduler allocated them
        (for a finished request: as they were in its last step; their pages keep
        their bytes until reused)."""
        if req_id in self.scheduler.requests:
            self.last_blocks[req_id] = list(
                self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            )
        return self.last_blocks[req_id]

    # ------------------------------------------------------------ driving

    def add(self, req_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=get_request_block_hasher(
                self.hash_block_size if self.hybrid else BLOCK, self.hash_fn
            ),
        )
        self.requests[req_id] = req
        self.scheduler.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, the worker side around a fake forward
        pass, and the scheduler's update from the output."""
        so = self.scheduler.schedule()
        self.finish_step(so)
        return so

    def finish_step(self, so: SchedulerOutput) -> None:
        """The rest of a step :meth:`step` began with ``schedule()`` (split so
        that a test can act between the scheduler's lookups and the worker)."""
        conn = self.worker_connector
        meta = so.kv_connector_metadata
        assert meta is not None
        conn.bind_connector_metadata(meta)
        conn.handle_preemptions(meta)
        conn.start_load_kv(None)  # type: ignore[arg-type]  # submits; waits for sync loads
        if self.hybrid:
            self._block_state(so)
        computed: dict[str, int] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            # schedule() already counted the scheduled tokens as computed.
            end = self.requests[req_id].num_computed_tokens
            computed[req_id] = end
            self._forward(req_id, end - n, end)
        conn.wait_for_save()
        out = KVConnectorOutput()
        # As vLLM 0.33's KVConnectorModelRunnerMixin: the transfer results carry
        # the failed receives (kvseal reports a hybrid model's failed load so).
        res = conn.get_transfer_results(so.finished_req_ids)
        out.finished_sending, out.finished_recving = res.finished_sending, res.finished_recving
        out.failed_recving = res.failed_recving
        out.invalid_block_ids = conn.get_block_ids_with_load_errors()
        out.kv_connector_worker_meta = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        sampled = [
            [7] if computed[r] >= self.requests[r].num_prompt_tokens else [] for r in req_ids
        ]
        # vLLM 0.34's ModelRunnerOutput has no req_id_to_index (the index is the
        # position in req_ids); 0.33's requires it.
        index = (
            {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
            if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__
            else {}
        )
        mro = ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=out, **index
        )
        self.outputs.append(self.scheduler.update_from_output(so, mro))

    def _block_state(self, so: SchedulerOutput) -> None:
        """What the model runner does to the KV cache before the forward pass:
        zero freshly allocated blocks, then the scheduler's block copies (Mamba
        align mode's copy-on-write), every layer slot of the backing buffer."""
        slots = sorted({(b, s) for b, s, _n in self.slots.values()})
        for bid in so.new_block_ids_to_zero or ():
            for base, stride in slots:
                self.buf[base + bid * stride : base + (bid + 1) * stride] = 0
        for src, dst in so.kv_cache_block_copies or ():
            for base, stride in slots:
                s0, d0 = base + src * stride, base + dst * stride
                self.buf[d0 : d0 + stride] = self.buf[s0 : s0 + stride].clone()

    def _forward_hybrid(self, req_id: str, start: int, end: int) -> None:
        """Every group's pages for tokens start..end: an attention group's
        blocks this step completes; a Mamba group's state at each block
        boundary reached, and the running state in the block of ``end``."""
        tokens = list(self.requests[req_id].prompt_token_ids or [])
        end = min(end, len(tokens))
        for gi, ids in enumerate(self.group_block_ids(req_id)):
            spec = self.kv_cache_config.kv_cache_groups[gi].kv_cache_spec
            layers = len(self.kv_cache_config.kv_cache_groups[gi].layer_names)
            bs = spec.block_size
            if isinstance(spec, MambaSpec):
                ends = [e for e in range((start // bs + 1) * bs, end + 1, bs)]
                if end % bs:
                    ends.append(end)
                todo = [(-(-e // bs) - 1, e) for e in ends]
            else:
                todo = [(b, (b + 1) * bs) for b in range(start // bs, end // bs)]
            for b, e in todo:
                if b >= len(ids) or ids[b] == 0:
                    continue  # a null block: nothing of the request lives there
                for li in range(layers):
                    self._write(gi, li, ids[b], self.expected_page(tokens, gi, li, e))

    def _forward(self, req_id: str, start: int, end: int) -> None:
        """Write the KV of the blocks this step completes (tokens start..end)."""
        if self.hybrid:
            self._forward_hybrid(req_id, start, end)
            return
        req = self.requests[req_id]
        tokens = list(req.prompt_token_ids or [])
        ids = self.block_ids(req_id)
        for b in range(start // BLOCK, min(end, len(tokens)) // BLOCK):
            for layer in range(LAYERS):
                off = layer * PAGE * NUM_BLOCKS + ids[b] * PAGE
                data = torch.frombuffer(bytearray(page_bytes(tokens, b, layer)), dtype=torch.int8)
                self.buf[off : off + PAGE] = data

    def run(self, timeout: float = 60.0) -> int:
        """Step until no request is left and no transfer is pending; returns the
        steps taken. A step that scheduled nothing is followed by a short pause
        (the transfers are asynchronous: an idle engine loop polls too).
        ``timeout`` is a liveness bound, not a timing assertion."""
        deadline = time.monotonic() + timeout
        steps = 0
        while self.scheduler.has_requests() or self._pending():
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not settle in {timeout} s")
            so = self.step()
            steps += 1
            if not so.num_scheduled_tokens:
                time.sleep(0.005)
        return steps

    def _pending(self) -> bool:
        conn = self.scheduler.connector
        return conn is not None and bool(conn.has_pending_push_work())  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        self.worker_connector.shutdown()
        conn = self.scheduler.connector
        if conn is not None:
            conn.shutdown()
