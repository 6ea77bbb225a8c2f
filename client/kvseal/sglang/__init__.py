"""kvseal inside SGLang: the sealed host KV tier as SGLang's direct-L3 cache linker.

Enable it with SGLang's external-linker flags naming
``kvseal.sglang.linker.KVSealLinker`` (docs/sglang.md has the line).

- :mod:`kvseal.sglang.linker` — the ``UnifiedCacheLinker`` (lookups answered
  locally, verified restores, offloads off the scheduler thread);
- :mod:`kvseal.sglang.layout` — SGLang's KV pages and kvseal's staging blocks;
- :mod:`kvseal.sglang.staging` — the staging blocks the daemon seals from;
- :mod:`kvseal.sglang.hooks` — each request's ``cache_salt`` to the linker;
- :mod:`kvseal.sglang.keys` — SGLang hashes, salts and models mapped to kvseal's.

Importing this package imports neither SGLang nor torch (``linker`` does).
"""
