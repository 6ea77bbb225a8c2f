from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_CPU: _ClassVar[Backend]
    BACKEND_CUDA: _ClassVar[Backend]

class BlockState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STATE_UNSPECIFIED: _ClassVar[BlockState]
    BLOCK_ABSENT: _ClassVar[BlockState]
    BLOCK_PENDING: _ClassVar[BlockState]
    BLOCK_READY: _ClassVar[BlockState]

class OffloadOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OFFLOAD_OUTCOME_UNSPECIFIED: _ClassVar[OffloadOutcome]
    OFFLOAD_STORED: _ClassVar[OffloadOutcome]
    OFFLOAD_ALREADY_PRESENT: _ClassVar[OffloadOutcome]
    OFFLOAD_IN_PROGRESS: _ClassVar[OffloadOutcome]

class StatsScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATS_SCOPE_UNSPECIFIED: _ClassVar[StatsScope]
    STATS_SCOPE_FACTS: _ClassVar[StatsScope]
    STATS_SCOPE_POOL: _ClassVar[StatsScope]
    STATS_SCOPE_DAEMON: _ClassVar[StatsScope]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    BLOCK_STORED: _ClassVar[EventKind]
    BLOCK_REMOVED: _ClassVar[EventKind]

class RemovalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REMOVAL_REASON_UNSPECIFIED: _ClassVar[RemovalReason]
    REMOVED_EVICTED: _ClassVar[RemovalReason]
    REMOVED_DROPPED: _ClassVar[RemovalReason]
    REMOVED_RELEASED: _ClassVar[RemovalReason]
    REMOVED_INTEGRITY: _ClassVar[RemovalReason]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    UNKNOWN_POOL: _ClassVar[ErrorReason]
    BAD_REQUEST: _ClassVar[ErrorReason]
    PAGE_OUT_OF_RANGE: _ClassVar[ErrorReason]
    BLOCK_NOT_PRESENT: _ClassVar[ErrorReason]
    CAPACITY_EXHAUSTED: _ClassVar[ErrorReason]
    INTEGRITY_FAILURE: _ClassVar[ErrorReason]
    HANDLE_UNUSABLE: _ClassVar[ErrorReason]
    BACKEND_MISMATCH: _ClassVar[ErrorReason]
    SHUTTING_DOWN: _ClassVar[ErrorReason]
    ENGINE_NOT_READY: _ClassVar[ErrorReason]
    DEADLINE_PASSED: _ClassVar[ErrorReason]
    CANCELLED: _ClassVar[ErrorReason]
    POOL_NAME_TAKEN: _ClassVar[ErrorReason]
    INTERNAL_ERROR: _ClassVar[ErrorReason]
    OBSERVER_POOL: _ClassVar[ErrorReason]
    TENANT_DROPPED: _ClassVar[ErrorReason]
BACKEND_UNSPECIFIED: Backend
BACKEND_CPU: Backend
BACKEND_CUDA: Backend
BLOCK_STATE_UNSPECIFIED: BlockState
BLOCK_ABSENT: BlockState
BLOCK_PENDING: BlockState
BLOCK_READY: BlockState
OFFLOAD_OUTCOME_UNSPECIFIED: OffloadOutcome
OFFLOAD_STORED: OffloadOutcome
OFFLOAD_ALREADY_PRESENT: OffloadOutcome
OFFLOAD_IN_PROGRESS: OffloadOutcome
STATS_SCOPE_UNSPECIFIED: StatsScope
STATS_SCOPE_FACTS: StatsScope
STATS_SCOPE_POOL: StatsScope
STATS_SCOPE_DAEMON: StatsScope
EVENT_KIND_UNSPECIFIED: EventKind
BLOCK_STORED: EventKind
BLOCK_REMOVED: EventKind
REMOVAL_REASON_UNSPECIFIED: RemovalReason
REMOVED_EVICTED: RemovalReason
REMOVED_DROPPED: RemovalReason
REMOVED_RELEASED: RemovalReason
REMOVED_INTEGRITY: RemovalReason
ERROR_REASON_UNSPECIFIED: ErrorReason
UNKNOWN_POOL: ErrorReason
BAD_REQUEST: ErrorReason
PAGE_OUT_OF_RANGE: ErrorReason
BLOCK_NOT_PRESENT: ErrorReason
CAPACITY_EXHAUSTED: ErrorReason
INTEGRITY_FAILURE: ErrorReason
HANDLE_UNUSABLE: ErrorReason
BACKEND_MISMATCH: ErrorReason
SHUTTING_DOWN: ErrorReason
ENGINE_NOT_READY: ErrorReason
DEADLINE_PASSED: ErrorReason
CANCELLED: ErrorReason
POOL_NAME_TAKEN: ErrorReason
INTERNAL_ERROR: ErrorReason
OBSERVER_POOL: ErrorReason
TENANT_DROPPED: ErrorReason

class BufferHandle(_message.Message):
    __slots__ = ("shm_name", "cuda_ipc_handle", "offset", "size", "device")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    cuda_ipc_handle: bytes
    offset: int
    size: int
    device: int
    def __init__(self, shm_name: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("buffer", "offset", "page_stride", "bytes")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    buffer: int
    offset: int
    page_stride: int
    bytes: int
    def __init__(self, buffer: _Optional[int] = ..., offset: _Optional[int] = ..., page_stride: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class PoolGeometry(_message.Message):
    __slots__ = ("num_pages", "tokens_per_page", "num_layers", "num_kv_heads", "head_dim", "dtype", "layout", "buffers", "segments", "block_bytes")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    tokens_per_page: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: str
    buffers: _containers.RepeatedCompositeFieldContainer[BufferHandle]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    block_bytes: int
    def __init__(self, num_pages: _Optional[int] = ..., tokens_per_page: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., layout: _Optional[str] = ..., buffers: _Optional[_Iterable[_Union[BufferHandle, _Mapping]]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("name", "model_fingerprint", "geometry", "backend", "owner_token", "observer", "identity")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OBSERVER_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_fingerprint: bytes
    geometry: PoolGeometry
    backend: Backend
    owner_token: bytes
    observer: bool
    identity: DeploymentIdentity
    def __init__(self, name: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ..., geometry: _Optional[_Union[PoolGeometry, _Mapping]] = ..., backend: _Optional[_Union[Backend, str]] = ..., owner_token: _Optional[bytes] = ..., observer: _Optional[bool] = ..., identity: _Optional[_Union[DeploymentIdentity, _Mapping]] = ...) -> None: ...

class DeploymentIdentity(_message.Message):
    __slots__ = ("label", "hash_algorithm", "hash_seed_check", "tenant_key_check", "hash_seed_random")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_CHECK_FIELD_NUMBER: _ClassVar[int]
    TENANT_KEY_CHECK_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_RANDOM_FIELD_NUMBER: _ClassVar[int]
    label: str
    hash_algorithm: str
    hash_seed_check: bytes
    tenant_key_check: bytes
    hash_seed_random: bool
    def __init__(self, label: _Optional[str] = ..., hash_algorithm: _Optional[str] = ..., hash_seed_check: _Optional[bytes] = ..., tenant_key_check: _Optional[bytes] = ..., hash_seed_random: _Optional[bool] = ...) -> None: ...

class RegisterPoolReply(_message.Message):
    __slots__ = ("pool_id", "namespace", "block_bytes", "backend", "server_instance", "owner_token", "warnings")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SERVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    namespace: bytes
    block_bytes: int
    backend: Backend
    server_instance: str
    owner_token: bytes
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool_id: _Optional[str] = ..., namespace: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., backend: _Optional[_Union[Backend, str]] = ..., server_instance: _Optional[str] = ..., owner_token: _Optional[bytes] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class UnregisterPoolReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldPoolRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class HoldPoolReply(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("pool_id", "tenant", "block_hashes")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    tenant: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool_id: _Optional[str] = ..., tenant: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("hit_blocks", "states")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    states: _containers.RepeatedScalarFieldContainer[BlockState]
    def __init__(self, hit_blocks: _Optional[int] = ..., states: _Optional[_Iterable[_Union[BlockState, str]]] = ...) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("pool_id", "tenant", "block_hashes")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    tenant: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool_id: _Optional[str] = ..., tenant: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TouchReply(_message.Message):
    __slots__ = ("touched",)
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    touched: int
    def __init__(self, touched: _Optional[int] = ...) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ("pool_id", "tenant", "parent_hash", "block_hashes", "page_ids", "cuda_event_ipc_handle", "grace_ms", "budget_us")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENT_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_US_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    tenant: bytes
    parent_hash: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    cuda_event_ipc_handle: bytes
    grace_ms: int
    budget_us: int
    def __init__(self, pool_id: _Optional[str] = ..., tenant: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., page_ids: _Optional[_Iterable[int]] = ..., cuda_event_ipc_handle: _Optional[bytes] = ..., grace_ms: _Optional[int] = ..., budget_us: _Optional[int] = ...) -> None: ...

class OffloadReply(_message.Message):
    __slots__ = ("outcomes", "stored_blocks", "stored_bytes", "evicted_blocks")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedScalarFieldContainer[OffloadOutcome]
    stored_blocks: int
    stored_bytes: int
    evicted_blocks: int
    def __init__(self, outcomes: _Optional[_Iterable[_Union[OffloadOutcome, str]]] = ..., stored_blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., evicted_blocks: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("pool_id", "tenant", "block_hashes", "page_ids", "release", "cuda_event_ipc_handle", "grace_ms", "budget_us")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENT_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_US_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    tenant: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    release: bool
    cuda_event_ipc_handle: bytes
    grace_ms: int
    budget_us: int
    def __init__(self, pool_id: _Optional[str] = ..., tenant: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., page_ids: _Optional[_Iterable[int]] = ..., release: _Optional[bool] = ..., cuda_event_ipc_handle: _Optional[bytes] = ..., grace_ms: _Optional[int] = ..., budget_us: _Optional[int] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ("restored_blocks", "restored_bytes")
    RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    restored_blocks: int
    restored_bytes: int
    def __init__(self, restored_blocks: _Optional[int] = ..., restored_bytes: _Optional[int] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("pool_id", "tenant", "block_hashes", "all_of_tenant")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ALL_OF_TENANT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    tenant: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    all_of_tenant: bool
    def __init__(self, pool_id: _Optional[str] = ..., tenant: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., all_of_tenant: _Optional[bool] = ...) -> None: ...

class DropReply(_message.Message):
    __slots__ = ("dropped_blocks",)
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    dropped_blocks: int
    def __init__(self, dropped_blocks: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("pool_id", "tenant", "block_hashes")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    tenant: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool_id: _Optional[str] = ..., tenant: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released_blocks",)
    RELEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    released_blocks: int
    def __init__(self, released_blocks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("server_instance", "backend", "backend_detail", "host_bytes_capacity", "host_bytes_used", "blocks_ready", "blocks_pending", "blocks_pinned", "pools", "lookups", "lookup_hit_blocks", "offloaded_blocks", "offloaded_bytes", "restored_blocks", "restored_bytes", "evicted_blocks", "dropped_blocks", "integrity_failures", "integrity_policy", "key_epoch", "seals_under_current_key", "rekey_after", "host_region", "pool_holds", "scope", "store_policy", "store_locality", "store_bytes_capacity", "store_bytes_used", "store_objects", "store_lookup_hit_blocks", "store_restored_blocks", "store_spilled_blocks", "store_evicted_blocks", "store_integrity_failures")
    SERVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_DETAIL_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_READY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PENDING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PINNED_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_POLICY_FIELD_NUMBER: _ClassVar[int]
    KEY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEALS_UNDER_CURRENT_KEY_FIELD_NUMBER: _ClassVar[int]
    REKEY_AFTER_FIELD_NUMBER: _ClassVar[int]
    HOST_REGION_FIELD_NUMBER: _ClassVar[int]
    POOL_HOLDS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    STORE_POLICY_FIELD_NUMBER: _ClassVar[int]
    STORE_LOCALITY_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    STORE_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    STORE_LOOKUP_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_SPILLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_INTEGRITY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    server_instance: str
    backend: Backend
    backend_detail: str
    host_bytes_capacity: int
    host_bytes_used: int
    blocks_ready: int
    blocks_pending: int
    blocks_pinned: int
    pools: int
    lookups: int
    lookup_hit_blocks: int
    offloaded_blocks: int
    offloaded_bytes: int
    restored_blocks: int
    restored_bytes: int
    evicted_blocks: int
    dropped_blocks: int
    integrity_failures: int
    integrity_policy: str
    key_epoch: int
    seals_under_current_key: int
    rekey_after: int
    host_region: str
    pool_holds: int
    scope: StatsScope
    store_policy: str
    store_locality: str
    store_bytes_capacity: int
    store_bytes_used: int
    store_objects: int
    store_lookup_hit_blocks: int
    store_restored_blocks: int
    store_spilled_blocks: int
    store_evicted_blocks: int
    store_integrity_failures: int
    def __init__(self, server_instance: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., backend_detail: _Optional[str] = ..., host_bytes_capacity: _Optional[int] = ..., host_bytes_used: _Optional[int] = ..., blocks_ready: _Optional[int] = ..., blocks_pending: _Optional[int] = ..., blocks_pinned: _Optional[int] = ..., pools: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_hit_blocks: _Optional[int] = ..., offloaded_blocks: _Optional[int] = ..., offloaded_bytes: _Optional[int] = ..., restored_blocks: _Optional[int] = ..., restored_bytes: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., dropped_blocks: _Optional[int] = ..., integrity_failures: _Optional[int] = ..., integrity_policy: _Optional[str] = ..., key_epoch: _Optional[int] = ..., seals_under_current_key: _Optional[int] = ..., rekey_after: _Optional[int] = ..., host_region: _Optional[str] = ..., pool_holds: _Optional[int] = ..., scope: _Optional[_Union[StatsScope, str]] = ..., store_policy: _Optional[str] = ..., store_locality: _Optional[str] = ..., store_bytes_capacity: _Optional[int] = ..., store_bytes_used: _Optional[int] = ..., store_objects: _Optional[int] = ..., store_lookup_hit_blocks: _Optional[int] = ..., store_restored_blocks: _Optional[int] = ..., store_spilled_blocks: _Optional[int] = ..., store_evicted_blocks: _Optional[int] = ..., store_integrity_failures: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("tenant", "pool_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: bytes
    pool_id: str
    def __init__(self, tenant: _Optional[bytes] = ..., pool_id: _Optional[str] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("sequence", "kind", "reason", "namespace", "tenant", "block_hashes", "medium", "locality", "restorable")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: EventKind
    reason: RemovalReason
    namespace: bytes
    tenant: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    locality: str
    restorable: bool
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., reason: _Optional[_Union[RemovalReason, str]] = ..., namespace: _Optional[bytes] = ..., tenant: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ..., locality: _Optional[str] = ..., restorable: _Optional[bool] = ...) -> None: ...
