"""The data path: two backends behind one interface.

- ``base``  the interface (:class:`~kvseal.server.backends.base.Backend`,
  :class:`~kvseal.server.backends.base.Region`) and the types both sides share.
- ``cpu/``  AES-256-GCM with ``cryptography`` on a few threads; engine pools in
  POSIX shared memory. The default without a GPU, and the reference twin.
- ``cuda/`` AES-256-GCM kernels on the GPU; engine pools over CUDA IPC.

Nothing is imported here: ``cuda/`` must stay unloaded on CPU-only installs.
"""
