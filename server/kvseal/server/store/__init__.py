"""The sealed store tier: sealed KV blocks on a (shared) directory, under a
deployment key that replicas and restarts share (docs/store.md).

The daemon uses it as an optional tier under the host tier (``--store-dir``;
``kvseal.server.cache.storetier``); it has its own tests too. Rooms, from the
bottom up: ``errors``; ``keysource`` (where the deployment key comes from:
``local``, ``file:``, ``cdh:``); ``keys`` (names and keys derived from it);
``record`` (the sealed object format, the package's one user of AES-GCM);
``backend`` (what the store needs from its storage), ``fsio`` (the
directory backend: shards, atomic publish, eviction), ``s3`` (the S3
backend, ``--store s3://``); ``scopes``
(per-tenant epochs and their lineage, drop); ``fsstore`` (:class:`FsStore`, the API). Nothing
is imported here.
"""
