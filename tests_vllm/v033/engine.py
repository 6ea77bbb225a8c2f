"""vLLM 0.33's own scheduler and worker-side connector, driven without a model.

:class:`Engine` builds what a vLLM 0.33 engine builds around kvseal, from the
0.33 wheel's own code: the ``VllmConfig`` (a local config.json, no weights, no
tokenizer), a ``KVCacheConfig`` of one full-attention group, vLLM's real
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
from kvseal.vllm import shm_kv
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
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
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

    def __post_init__(self) -> None:
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

    def page(self, block_id: int, layer: int) -> bytes:
        off = layer * PAGE * NUM_BLOCKS + block_id * PAGE
        return bytes(self.buf[off : off + PAGE].numpy().tobytes())

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
            block_hasher=get_request_block_hasher(BLOCK, self.hash_fn),
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
        computed: dict[str, int] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            # schedule() already counted the scheduled tokens as computed.
            end = self.requests[req_id].num_computed_tokens
            computed[req_id] = end
            self._forward(req_id, end - n, end)
        conn.wait_for_save()
        out = KVConnectorOutput()
        out.finished_sending, out.finished_recving = conn.get_finished(so.finished_req_ids)
        out.invalid_block_ids = conn.get_block_ids_with_load_errors()
        out.kv_connector_worker_meta = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        sampled = [
            [7] if computed[r] >= self.requests[r].num_prompt_tokens else [] for r in req_ids
        ]
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=out,
        )
        self.outputs.append(self.scheduler.update_from_output(so, mro))

    def _forward(self, req_id: str, start: int, end: int) -> None:
        """Write the KV of the blocks this step completes (tokens start..end)."""
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
