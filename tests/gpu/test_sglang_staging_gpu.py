"""The SGLang linker's GPU path on a real GPU (``make device-check``; skipped
without one): SGLang-layout K/V tensors and the linker's staging blocks in
device memory, the staging blocks exported over CUDA IPC to
``kvseal-server --backend cuda``, pages gathered, sealed, restored and
scattered back byte for byte (:func:`tests.test_sglang_staging.staging_round_trip`,
whose CPU twin runs in ``make test``). SGLang itself is too large for the
device machine; the linker's only GPU-specific code is this path.

Test names with "daemon" run in the device check's daemon half (``-k daemon``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

for _var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
    os.environ[_var] = "expandable_segments:False"  # legacy CUDA IPC needs it (test_cuda_backend)
torch = pytest.importorskip("torch")

from kvseal.server.backends.cuda import compile as kc  # noqa: E402
from kvseal.server.backends.cuda import probe  # noqa: E402
from kvseal.v1 import kvseal_pb2 as pb  # noqa: E402

from ..conftest import start_daemon  # noqa: E402
from ..test_sglang_staging import staging_round_trip  # noqa: E402

_ok, _why = probe.cuda_available(0)
if not _ok:
    pytest.skip(f"no usable GPU: {_why}", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip(f"torch {torch.__version__} has no usable CUDA ({_why})", allow_module_level=True)

pytestmark = pytest.mark.gpu


def test_daemon_sglang_staging_round_trip_over_cuda(tmp_path: Path) -> None:
    major, minor = torch.cuda.get_device_capability(0)
    try:
        kc.compile_kernels(f"sm_{major}{minor}")
    except kc.NvrtcError:
        kc.compile_kernels(kc.DEFAULT_ARCH, output="ptx")
    d = start_daemon(tmp_path / "d", "--backend", "cuda", "--device", "0", host_bytes="16MiB")
    try:
        staging_round_trip(d.target, torch.device("cuda", 0), pb.BACKEND_CUDA)
    finally:
        d.stop()
        print(f"---- daemon log (last 4000 chars) ----\n{d.log()[-4000:]}")
