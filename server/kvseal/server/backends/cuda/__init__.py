"""GPU data path of kvseal: AES-256-GCM seal/verify/open kernels, their CPU emulation
(:mod:`kvseal.server.backends.cuda.emulated`) and NVRTC compilation
(:mod:`kvseal.server.backends.cuda.compile`)."""
