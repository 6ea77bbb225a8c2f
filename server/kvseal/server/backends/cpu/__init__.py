"""The CPU backend: ``backend`` (:class:`~kvseal.server.backends.cpu.backend.CpuBackend`
and its shared-memory pool mapping, :class:`CpuMappedPool`). Its host region is
:class:`kvseal.server.hostregion.HostRegion`."""
