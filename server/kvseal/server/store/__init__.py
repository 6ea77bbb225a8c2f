"""The sealed store tier: sealed KV blocks on a (shared) directory, under a
deployment key that replicas and restarts share (docs/store.md).

A library with its own tests; the daemon does not use it yet. Rooms, from the
bottom up: ``errors``; ``keysource`` (where the deployment key comes from:
``local``, ``file:``, ``cdh:``); ``keys`` (names and keys derived from it);
``record`` (the sealed object format, the package's one user of AES-GCM);
``fsio`` (the directory: shards, atomic publish, eviction); ``scopes``
(per-tenant epochs, drop); ``fsstore`` (:class:`FsStore`, the API). Nothing
is imported here.
"""
