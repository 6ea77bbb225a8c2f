"""kvseal inside vLLM: the sealed host KV tier as a vLLM offloading spec.

Enable it with one ``--kv-transfer-config`` line naming
``KVSealOffloadingConnector`` from :mod:`kvseal.vllm.connector` (docs/vllm.md).

- :mod:`kvseal.vllm.connector` — the connector (vLLM's OffloadingConnector plus
  shared-memory KV cache on the CPU platform, cache_salt tenants, recompute on
  a failed restore);
- :mod:`kvseal.vllm.spec` — ``KVSealOffloadingSpec`` and its worker
  (transfers off vLLM's thread); it re-exports the manager;
- :mod:`kvseal.vllm.manager` — the manager (scheduler process, lookups
  answered locally, pending stores);
- :mod:`kvseal.core.mirror` — the scheduler's event-fed copy of the daemon's
  index;
- :mod:`kvseal.vllm.keys` — vLLM hashes, salts and models mapped to kvseal's.

Importing this package imports neither vLLM nor torch (the submodules
``spec``, ``manager`` and ``connector`` do); it never imports server code.
"""
