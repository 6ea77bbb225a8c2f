"""The CUDA backend: AES-256-GCM kernels on the GPU, engine pools over CUDA IPC.

- ``backend``  :class:`~kvseal.server.backends.cuda.backend.CudaBackend`, the
  backend interface: locking, request steps, failure handling;
- ``device``   the driver calls (``Device``, ``CudaDevice``) and context health;
- ``emulated_device`` a ``Device`` in host memory over the kernel emulator;
- ``ipc``      engine pools and engine events opened from IPC handles;
- ``keys``     device key contexts (``DeviceKeySource`` is what the sealer gives);
- ``pipeline`` one request's copies and kernel launches, stage by stage;
- ``launch``   launch descriptors, chunking, host-side descriptor checks;
- ``region``   pinned host memory that holds only ciphertext;
- ``probe``    is a GPU usable, is CC mode on (no cuda-python needed to ask);
- ``compile``  NVRTC compilation of ``kernels.cu``; ``emulated`` the g++-built
  CPU emulator of the same kernels (``emulate.cpp``) and the ctypes mirrors of
  their structures (``kernels.cuh``, ``aesgcm.cuh``).

Nothing is imported here: importing a submodule never loads cuda-python.
"""
