"""The engine-neutral client core that both engine adapters share.

:mod:`kvseal.vllm` and :mod:`kvseal.sglang` import this package; it imports
neither (``tests/test_client_shape.py`` holds every package to its layer), so a
change made for one engine is tested through both.

- :mod:`kvseal.core.mirror` — an event-fed copy of the daemon's index, so
  lookups are answered in the engine process (``mirror_rounds``: its resync,
  touch and verify rounds);
- :mod:`kvseal.core.kv_pool` — one engine pool registered with a daemon:
  offload and restore by page, held registration, re-registration after a
  daemon restart;
- :mod:`kvseal.core.shm_kv` — an engine's CPU KV cache allocated in a named,
  owner-locked POSIX shared-memory object the CPU backend can open;
- :mod:`kvseal.core.discovery` — which blocks the daemon holds that the
  engine's mirror has not seen (another replica's, a restarted daemon's);
- :mod:`kvseal.core.geometry` — the observer pool's geometry.

Importing this package imports no engine; ``shm_kv`` and ``kv_pool`` import
torch when used.
"""
