"""kvseal daemon: a sealed (AES-256-GCM) host-memory KV-cache tier for one GPU.

Modules, from the bottom up:

- ``sealing``    the only module that touches AES-GCM (keys, nonces, AAD).
- ``hostregion`` the untrusted host region (ciphertext only) and its allocator.
- ``index``      the trusted in-process index: block -> slot, nonce, tag, LRU.
- ``pools``      registered engine KV pools (geometry, mapping, gather/scatter).
- ``backend``    batched seal/open of blocks (CPU here; CUDA in ``cuda/``).
- ``cache``      the orchestration: lookup/offload/restore/drop semantics.
- ``service``    the gRPC edge; ``convert`` maps proto <-> domain types.
- ``main``       CLI, process hardening, serving and shutdown.
"""
