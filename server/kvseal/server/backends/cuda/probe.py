"""Cheap questions about the machine, asked before the CUDA backend is built.

- :func:`cuda_available` answers ``--backend auto``: does the driver load and does
  the device exist? It never raises; the reason comes back as text for the log.
- :func:`cc_mode` says whether the GPUs run in confidential-computing mode, via
  NVML's ``nvmlSystemGetConfComputeState``. cuda-bindings 13.0 ships no NVML
  module, so this talks to ``libnvidia-ml.so.1`` through :mod:`ctypes`.
  The answer decides how the host region is allocated (in CC mode
  ``cuMemHostRegister`` is refused with error 801, so only ``cuMemHostAlloc`` is
  used).

``KVSEAL_CC_MODE=on|off`` overrides the NVML answer. It exists so that the CC code
path (cuMemHostAlloc only, no registered file) can be exercised on a GPU that is
not in CC mode; it can never make a CC machine use ``cuMemHostRegister`` safely,
it only makes the driver refuse it (which is handled).

Nothing here imports cuda-python at module import time.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from typing import Any

__all__ = ["DRIVER_MODULES", "cc_mode", "cuda_available", "device_summary", "driver_module"]

# cuda-python's driver bindings: ``cuda.bindings.driver`` since cuda-python 12.6
# (cuda-bindings), ``cuda.cuda`` before (same functions, types and return tuples).
DRIVER_MODULES = ("cuda.bindings.driver", "cuda.cuda")

_NVML_SUCCESS = 0
_NVML_CC_FEATURE_ENABLED = 1


class _NvmlCcState(ctypes.Structure):
    """``nvmlConfComputeSystemState_t`` (nvml.h)."""

    _fields_ = (
        ("environment", ctypes.c_uint),
        ("ccFeature", ctypes.c_uint),
        ("devToolsMode", ctypes.c_uint),
    )


def driver_module() -> Any:
    """The cuda-python driver module (see :data:`DRIVER_MODULES`); ImportError when
    cuda-python is not installed. Importing it does not load libcuda."""
    first: ImportError | None = None
    for name in DRIVER_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            first = first or e
    raise ImportError(f"no cuda-python driver bindings ({' or '.join(DRIVER_MODULES)}): {first}")


_driver = driver_module


def _err_name(cu: Any, err: Any) -> str:
    """ "CUDA_ERROR_NO_DEVICE (100)": CUresult is an IntEnum, so no driver call is needed."""
    try:
        return f"{cu.CUresult(int(err)).name} ({int(err)})"
    except (ValueError, AttributeError):
        return f"CUresult {int(err)}"


def cuda_available(device: int = 0) -> tuple[bool, str]:
    """(True, "<GPU name> (device N, sm_XY)") when the CUDA driver loads and
    ``device`` exists; otherwise (False, why). Never raises."""
    try:
        cu = _driver()
    except ImportError as e:
        return False, f"cuda-python (cuda-bindings) is not installed: {e}"
    try:
        (err,) = cu.cuInit(0)
    except RuntimeError as e:  # the bindings raise when libcuda.so.1 cannot be loaded
        return False, f"the NVIDIA driver (libcuda.so.1) cannot be loaded: {e}"
    if int(err) != 0:
        return False, f"cuInit failed: {_err_name(cu, err)} (no usable GPU or driver)"
    err, count = cu.cuDeviceGetCount()
    if int(err) != 0:
        return False, f"cuDeviceGetCount failed: {_err_name(cu, err)}"
    if count == 0:
        return False, "the driver sees no GPU"
    if not 0 <= device < count:
        return False, f"--device {device} does not exist (the driver sees {count} GPU(s))"
    try:
        return True, device_summary(device)
    except RuntimeError as e:
        return False, str(e)


def device_summary(device: int) -> str:
    """ "NVIDIA H200 (device 0, sm_90)"; raises RuntimeError when the driver fails."""
    cu = _driver()
    err, dev = cu.cuDeviceGet(device)
    if int(err) != 0:
        raise RuntimeError(f"cuDeviceGet({device}) failed: {_err_name(cu, err)}")
    err, raw = cu.cuDeviceGetName(256, dev)
    name = raw.split(b"\0", 1)[0].decode(errors="replace") if int(err) == 0 else "unknown GPU"
    attr = cu.CUdevice_attribute
    err1, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    err2, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    arch = f"sm_{major}{minor}" if int(err1) == 0 and int(err2) == 0 else "sm_?"
    return f"{name} (device {device}, {arch})"


def cc_mode() -> str:
    """ "on", "off", or "unknown: <why>". Never raises.

    ``KVSEAL_CC_MODE`` (on/off) overrides NVML; see the module docstring.
    """
    forced = os.environ.get("KVSEAL_CC_MODE", "").strip().lower()
    if forced in ("on", "off"):
        return forced
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        return f"unknown: NVML (libnvidia-ml.so.1) is not available: {e}"
    try:
        init = nvml.nvmlInit_v2
        get = nvml.nvmlSystemGetConfComputeState
    except AttributeError as e:
        return f"unknown: this NVML has no confidential-computing query ({e})"
    init.restype = ctypes.c_int
    get.restype = ctypes.c_int
    get.argtypes = (ctypes.POINTER(_NvmlCcState),)
    rc = init()
    if rc != _NVML_SUCCESS:
        return f"unknown: nvmlInit failed with NVML error {rc}"
    try:
        state = _NvmlCcState()
        rc = get(ctypes.byref(state))
        if rc != _NVML_SUCCESS:
            return f"unknown: nvmlSystemGetConfComputeState failed with NVML error {rc}"
        return "on" if state.ccFeature == _NVML_CC_FEATURE_ENABLED else "off"
    finally:
        nvml.nvmlShutdown()
