"""kvseal daemon: a sealed (AES-256-GCM) host-memory KV-cache tier for one GPU.

Rooms, from the bottom up (docs/architecture.md follows a request through them):

- ``sealing``    the only module that touches AES-GCM (keys, nonces, AAD).
- ``hostregion`` the untrusted host region (ciphertext only) and its allocator.
- ``index/``     the trusted in-process index: block -> slot, nonce, tag, LRU.
- ``pools``      registered engine KV pools (geometry, validation, registry).
- ``backends/``  the data path: the interface (``base``) and its two twins,
  ``cpu/`` and ``cuda/`` (batched seal/open between pool and region).
- ``cache/``     the orchestration: lookup/offload/restore/drop semantics.
- ``service``    the gRPC edge; ``convert`` maps proto <-> domain types;
  ``peercred`` the uid-checking relay in front of it.
- ``daemon/``    CLI, process hardening, serving and shutdown; ``main`` the entry point.

Shared by several rooms: ``deadline``, ``events``, ``telemetry``, ``errors``,
``config``, ``locks``, ``timers``. Nothing is imported here.
"""
