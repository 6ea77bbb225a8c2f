"""The periodic device check (``--device-check-interval``): a CUDA context lost
while the daemon is idle turns health NOT_SERVING and ends the daemon with exit
status 4, as a failure inside a request does, with no request sent. And, at the
end, what of the one-shot GPU run on a device machine (scripts/device_check.sh,
its installer scripts/device_deps.py, its wheels, the GPU tests' byte reporter)
can be checked without a GPU.

The CUDA backend runs on the emulated device (``EmulatedDevice.lose_context``
stands in for an Xid or a GPU reset): the backend alone, a real daemon in this
process (``Daemon.create``: gRPC, the relay, the health service), and
``kvseal-server``'s ``main()`` as a process of its own.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvseal.client import ClientConfig, KVSealClient
from kvseal.server import sealing
from kvseal.server.backends.cpu.backend import CpuBackend
from kvseal.server.backends.cuda import emulated as E
from kvseal.server.backends.cuda.backend import CudaBackend
from kvseal.server.backends.cuda.emulated_device import EmulatedDevice
from kvseal.server.config import ServerConfig
from kvseal.server.daemon import cli
from kvseal.server.daemon import daemon as daemon_mod

from .conftest import until, wait_serving

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module", autouse=True)
def emu() -> E.Emulator:
    try:
        return E.load_emulator()
    except E.EmulatorUnavailable as exc:
        pytest.skip(f"CPU emulator unavailable: {exc}")


def broken(b: CudaBackend) -> str | None:
    """``b.broken`` read afresh (an attribute mypy would narrow across calls)."""
    return b.broken


@pytest.fixture
def backend() -> Iterator[tuple[CudaBackend, EmulatedDevice]]:
    dev = EmulatedDevice()
    b = CudaBackend(sealing.BlockSealer(2**32), 0, dev=dev, cc="off")
    yield b, dev
    dev.lost = False  # let close() release what it holds
    b.close()


def test_check_finds_a_context_lost_while_idle(
    backend: tuple[CudaBackend, EmulatedDevice],
) -> None:
    b, dev = backend
    reports: list[str] = []
    b.set_on_broken(reports.append)
    b.check_device()
    assert broken(b) is None and reports == []
    dev.lose_context()
    b.check_device()
    assert broken(b) is not None and len(reports) == 1
    assert "CONTEXT_IS_DESTROYED" in reports[0]
    b.check_device()  # already broken: reported once
    assert len(reports) == 1


def test_check_never_waits_for_a_request_in_flight(
    backend: tuple[CudaBackend, EmulatedDevice],
) -> None:
    """While a request holds the backend (its lock), the check skips: that request
    meets the loss itself; the next check after it finds it."""
    b, dev = backend
    dev.lose_context()
    with b._lock:  # a request in flight
        done = threading.Event()

        def check() -> None:
            b.check_device()
            done.set()

        t = threading.Thread(target=check)
        t.start()
        t.join(timeout=30)  # bounds a broken build; the check returns at once
        assert done.is_set(), "the check waited for the request"
        assert broken(b) is None
    b.check_device()
    assert broken(b) is not None


def test_check_after_close_touches_nothing(
    backend: tuple[CudaBackend, EmulatedDevice],
) -> None:
    b, dev = backend
    b.close()
    dev.lose_context()  # a device released by close() is no longer checked
    b.check_device()
    assert broken(b) is None


def test_cpu_check_is_a_no_op() -> None:
    b = CpuBackend(sealing.BlockSealer(2**32), 1)
    try:
        b.check_device()
    finally:
        b.close()


def test_interval_flag_and_its_bounds() -> None:
    assert ServerConfig().device_check_interval == 5.0
    assert cli.config_from_args(["--device-check-interval", "0"]).device_check_interval == 0
    with pytest.raises(ValueError, match="device-check-interval"):
        ServerConfig(device_check_interval=-1)
    with pytest.raises(ValueError, match="device-check-interval"):
        ServerConfig(device_check_interval=float("nan"))


class HealthWatch:
    """A grpc.health.v1 Watch stream on its own thread: ``statuses`` as they come,
    up to NOT_SERVING; ``opened`` is set once the first status arrived."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.statuses: list[int] = []
        self.opened = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with grpc.insecure_channel(self.target) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                # The timeout bounds a broken build (a daemon that never notices).
                for reply in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60):
                    self.statuses.append(reply.status)
                    self.opened.set()
                    if reply.status == NOT_SERVING:
                        return
        except BaseException as e:
            self.error = e
        finally:
            self.opened.set()

    def join(self) -> list[int]:
        self._thread.join(timeout=90)
        assert self.error is None, self.error
        return self.statuses


def _daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dev: EmulatedDevice
) -> daemon_mod.Daemon:
    """A started daemon (``Daemon.create``, gRPC, the relay, health) in this process
    on the CUDA backend over ``dev``, checking the device every 50 ms; its socket is
    ``tmp_path/run/k.sock``."""
    monkeypatch.setattr(
        daemon_mod,
        "make_backend",
        lambda cfg, sealer: CudaBackend(sealer, cfg.device, dev=dev, cc="off"),
    )
    args = ["--listen", f"unix://{tmp_path / 'run' / 'k.sock'}", "--backend", "cuda"]
    args += ["--host-bytes", "1MiB", "--grace", "1", "--device-check-interval", "0.05"]
    d = daemon_mod.Daemon.create(cli.config_from_args(args))
    d.start()
    return d


def test_daemon_stops_serving_and_exits_4_when_the_context_is_lost_while_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real daemon in this process on the emulated CUDA backend: the context is
    lost with no request in flight and none is sent; the health stream turns
    NOT_SERVING and the daemon ends with exit status 4."""
    dev = EmulatedDevice()
    checks = [0]
    real_check = dev.check_context

    def counted() -> None:
        checks[0] += 1
        real_check()

    dev.check_context = counted  # type: ignore[method-assign]
    d = _daemon(tmp_path, monkeypatch, dev)
    sock = tmp_path / "run" / "k.sock"
    try:
        watch = HealthWatch(f"unix://{sock}")
        watch.opened.wait(60)
        until(lambda: checks[0] >= 3, "three periodic device checks")
        assert not d.stop_event.is_set(), "a healthy context failed the check"
        dev.lose_context()
        assert watch.join() == [SERVING, NOT_SERVING]
    finally:
        d.begin_shutdown()  # only if the check failed to (the exit code stays 4 if set)
        code = d.wait()
    assert code == daemon_mod.EXIT_BACKEND == 4


def test_a_check_that_cannot_run_is_turned_off_and_the_daemon_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A check that cannot run at all (here: bindings without the driver call, a
    defect rather than a lost device) is logged and turned off; the daemon keeps
    serving (requests still find a lost context themselves)."""
    dev = EmulatedDevice()
    calls = [0]

    def no_such_call() -> None:
        calls[0] += 1
        raise RuntimeError('Function "cuCtxSynchronize" not found')

    dev.check_context = no_such_call  # type: ignore[method-assign]
    d = _daemon(tmp_path, monkeypatch, dev)
    sock = tmp_path / "run" / "k.sock"
    try:
        until(lambda: "the periodic device check cannot run" in caplog.text, "the log line")
        for t in threading.enumerate():
            if t.name == "kvseal-device-check":
                t.join(timeout=30)  # this daemon's ends; earlier tests' ended at their stop
                assert not t.is_alive()
        assert calls[0] == 1
        with KVSealClient(ClientConfig(target=f"unix://{sock}", timeout_s=5)) as c:
            assert c.health() == "SERVING"
        assert not d.stop_event.is_set()
    finally:
        d.begin_shutdown()
        code = d.wait()
    assert code == 0


_DAEMON = """
import signal, sys
from kvseal.server import main as m
from kvseal.server.backends.cuda.backend import CudaBackend
from kvseal.server.backends.cuda.emulated_device import EmulatedDevice
from kvseal.server.daemon import daemon as d
dev = EmulatedDevice()
d.make_backend = lambda cfg, sealer: CudaBackend(sealer, cfg.device, dev=dev, cc="off")
signal.signal(signal.SIGUSR1, lambda *_: dev.lose_context())
sys.exit(m.main(sys.argv[1:]))
"""


def test_daemon_process_exits_4_after_a_context_lost_while_idle(tmp_path: Path) -> None:
    """The same as a process (``kvseal-server``'s main() on the emulated CUDA
    backend); SIGUSR1 (this test's stand-in for an Xid) loses the context; no
    request is sent. Health turns NOT_SERVING, the process exits with status 4
    (systemd's Restart=on-failure and Kubernetes restart it), and the log says
    why."""
    sock = tmp_path / "run" / "k.sock"
    log_path = tmp_path / "daemon.log"
    args = ["--listen", f"unix://{sock}", "--backend", "cuda", "--host-bytes", "1MiB"]
    args += ["--grace", "1", "--device-check-interval", "0.05"]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-c", _DAEMON, *args],
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_serving(f"unix://{sock}", proc, log_path)
        watch = HealthWatch(f"unix://{sock}")
        watch.opened.wait(60)  # the stream is open (SERVING) before the loss
        proc.send_signal(signal.SIGUSR1)
        assert watch.join() == [SERVING, NOT_SERVING], log_path.read_text()
        assert proc.wait(timeout=60) == 4, log_path.read_text()
        log = log_path.read_text()
        assert "found by the periodic device check" in log and "CUDA backend unusable" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------
# scripts/device_check.sh, the one-shot GPU run on a device machine (no GPU here: what
# can be checked without one: its stages, its wheels, its installer, its reports)
# --------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check.sh"


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _mk_words(var: str) -> list[str]:
    """The words of a ``VAR := ...`` assignment (with continuation lines) in mk/cuda.mk."""
    text = (ROOT / "mk" / "cuda.mk").read_text().replace("\\\n", " ")
    m = re.search(rf"^{var}\s*:?=\s*(.*)$", text, re.M)
    assert m, var
    return m.group(1).split()


def _stages() -> list[str]:
    m = re.search(r'^ALL_STAGES="([^"]+)"', SCRIPT.read_text(), re.M)
    assert m
    return m.group(1).split()


def test_device_check_runs_the_in_process_half_before_the_daemon_half() -> None:
    """The GPU's bytes against cryptography's AESGCM come first: a symmetric AES bug
    (the same wrong keystream both ways) would pass the daemon's round trip."""
    st = _stages()
    assert st[:4] == ["env", "probe", "deps", "nvrtc"]
    assert st.index("inprocess") < st.index("preflight") < st.index("daemon") < st.index("bench")


def _run_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(out), **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_device_check_without_a_gpu_stops_after_the_probe(tmp_path: Path) -> None:
    """On this CPU machine: env facts, then the probe finds no GPU (exit 3); the
    summary names the stages in their order, the diagnostic switch and the
    cuda-bindings version (inside the tested range: no warning)."""
    r = _run_script(tmp_path, STAGES="", KVSEAL_KERNELS_SAFE="1")
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "stages: env probe deps nvrtc inprocess preflight daemon bench" in summary
    assert "KVSEAL_KERNELS_SAFE=1" in summary
    assert re.search(r"^\| probe \| NO GPU \|", summary, re.M), summary
    setup = (tmp_path / "out" / "setup.log").read_text()
    line = next(ln for ln in setup.splitlines() if ln.startswith("cuda-bindings: "))
    assert "WARNING" not in line, line


def test_the_tested_cuda_bindings_range_is_mk_cuda_s() -> None:
    """The env stage warns outside the versions CI tests (the pinned NVRTC
    compile-only one and CUDA_BINDINGS_NEWEST): the script's range is mk/cuda.mk's."""
    pinned = next(w for w in _mk_words("KERNELS_NVRTC_PKGS") if w.startswith("cuda-bindings=="))
    newest = _mk_words("CUDA_BINDINGS_NEWEST")[0]
    lo = tuple(int(x) for x in pinned.split("==")[1].split("."))
    hi = tuple(int(x) for x in newest.split(".")[:2])
    m = re.search(r"^TESTED = (\(\([\d, ]+\), \([\d, ]+\)\))$", SCRIPT.read_text(), re.M)
    assert m and ast.literal_eval(m.group(1)) == (lo, hi), m


def test_device_check_allows_a_cold_torch_and_gpu_start() -> None:
    """The env stage imports torch and initialises CUDA on a fresh machine: its limit
    (and its Python's) allow a cold start, and the probe's too."""
    text = SCRIPT.read_text()
    env = int(re.search(r"^stage env setup (\d+) ", text, re.M).group(1))  # type: ignore[union-attr]
    facts = int(re.search(r"^    timeout (\d+) \"\$PY\" - \"\$DEVICE\"", text, re.M).group(1))  # type: ignore[union-attr]
    probe = int(re.search(r"^    stage probe setup (\d+) ", text, re.M).group(1))  # type: ignore[union-attr]
    assert facts >= 60 and env > facts and probe >= 45


def test_device_wheels_are_only_what_the_image_lacks_and_pinned() -> None:
    """``make device-wheels``: the wheels the device image lacks (and grpcio/protobuf,
    installed there only if the image's are too old), each pinned at
    requirements-dev.txt's version, none of what the image has; no venv is built for
    it, and ``--no-deps`` downloads exactly that list."""
    wheels = dict(w.split("==") for w in _mk_words("DEVICE_WHEELS"))
    assert all(wheels.values())
    need = {"cryptography", "grpcio-health-checking", "grpcio-reflection",
            "opentelemetry-api", "opentelemetry-sdk"}  # fmt: skip
    assert need <= set(wheels)
    image = {"torch", "numpy", "pytest", "pytest-timeout", "hypothesis", "prometheus-client",
             "cuda-bindings", "typing-extensions", "cryptography-vectors"}  # fmt: skip
    assert not image & set(wheels)
    dev = dict(
        ln.split("==")
        for ln in (ROOT / "requirements-dev.txt").read_text().splitlines()
        if "==" in ln and not ln.startswith("#")
    )
    for name, version in wheels.items():
        if name in dev:
            assert dev[name].split()[0] == version, name
    dry = subprocess.run(["make", "-n", "-s", "device-wheels"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "--no-deps" in dry.stdout and " download " in dry.stdout
    assert "-m venv" not in dry.stdout and "pip install" not in dry.stdout, dry.stdout


def _wheel(d: Path, dist: str, version: str, module: str) -> Path:
    """A minimal pure-Python wheel of ``dist`` whose ``module`` sets VERSION."""
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kvseal-test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    path = d / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
    return path


def test_device_deps_selects_what_the_image_lacks(tmp_path: Path) -> None:
    deps = _load(ROOT / "scripts" / "device_deps.py", "device_deps_sel")
    names = ["cryptography-50.0.2-cp311-abi3-manylinux_2_28_x86_64.whl",
             "grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.whl",
             "grpcio_health_checking-1.85.1-py3-none-any.whl",
             "protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl"]  # fmt: skip
    image = {"grpcio": "1.80.0", "protobuf": "6.33.0", "cryptography": "49.0.0"}
    chosen, held, lines = deps.select([tmp_path / n for n in names], image.get)
    assert [p.name for p in chosen] == [names[2]]  # absent from the image
    assert [p.name for p in held] == [names[1], names[3]]  # only if kvseal's imports fail
    assert "keep cryptography (the image's 49.0.0)" in lines
    with pytest.raises(ValueError, match="two wheels of grpcio"):
        deps.select([tmp_path / names[1], tmp_path / "grpcio-1.86.0-py3-none-any.whl"])


def test_device_deps_installs_offline_blind_to_pip_configuration(tmp_path: Path) -> None:
    """The installer on this machine, against a pip configuration that would break a
    plain ``pip install --target`` (user installs and an unreachable index, from the
    environment and from a user and a site config file): the wheel lands in the
    target, offline, and the image's other packages stay the image's."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "kvseal-devtest-dummy", "1.0", "kvseal_devtest_dummy")
    bad = "[global]\nuser = true\nindex-url = http://127.0.0.1:9/simple\n[install]\nuser = true\n"
    (tmp_path / "xdg" / "pip").mkdir(parents=True)
    (tmp_path / "xdg" / "pip" / "pip.conf").write_text(bad)
    (tmp_path / "site.conf").write_text(bad)
    target = tmp_path / "target"
    env = {**os.environ, "PIP_USER": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_CONFIG_FILE": str(tmp_path / "site.conf"), "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), str(ROOT / "server")])}  # fmt: skip
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_deps.py"), str(wheels),
                        str(target)], env=env, capture_output=True, text=True, timeout=300,
                       check=False)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "install kvseal-devtest-dummy 1.0 (not in the image)" in out
    assert "imports OK" in out, out
    assert (target / "kvseal_devtest_dummy" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    assert not (target / "grpc").exists()  # the image's grpcio was good enough


def test_offset_reporter_names_the_first_differing_byte() -> None:
    """tests/gpu/bytes_check.py, what the GPU tests compare with: a 4 MiB block
    differing at one byte fails with that offset and a short hex context (one line,
    not pytest's diff of two 4 MiB strings)."""
    bc = _load(ROOT / "tests" / "gpu" / "bytes_check.py", "bytes_check_t")
    want = bytes(range(256)) * (4 << 12)
    for off in (0, 15, 16, 65535, 65536, 3_000_001, len(want) - 1):
        got = bytearray(want)
        got[off] ^= 0x40
        got[off + 1 :] = bytes(len(want) - off - 1)  # later bytes differ too
        assert bc.first_difference(got, want) == off
        with pytest.raises(AssertionError) as ei:
            bc.assert_same_bytes(memoryview(got), want, "page 3")
        msg = str(ei.value)
        assert msg.startswith(f"page 3: first difference at offset {off} (AES block {off // 16}")
        assert "\n" not in msg and len(msg) < 400
        assert f"{got[off]:02x}" in msg.split("| want", maxsplit=1)[0]
    assert bc.first_difference(want, bytes(want)) is None
    bc.assert_same_bytes(want, bytearray(want))
    assert bc.first_difference(want[:100], want) == 100  # a prefix: differs at its end
    assert "got 100 bytes, want" in bc.describe_difference(want[:100], want)


def _fake_libcuda(tmp_path: Path) -> Path:
    """A directory holding tests/gpu/fake_libcuda.c built as libcuda.so.1 (skips
    without a C compiler or NVRTC)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake libcuda")
    try:
        from kvseal.server.backends.cuda import compile as kc

        kc.nvrtc_version()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    lib = tmp_path / "fakecuda"
    lib.mkdir()
    src = ROOT / "tests" / "gpu" / "fake_libcuda.c"
    subprocess.run([cc, "-O1", "-fPIC", "-shared", "-o", str(lib / "libcuda.so.1"), str(src),
                    "-ldl"], check=True, timeout=120)  # fmt: skip
    return lib


def test_ipc_preflight_makes_the_daemons_mapping_calls(tmp_path: Path) -> None:
    """The preflight's daemon side, over the fake driver, asks which GPU holds the
    mapping and for its address range right after opening it, as the daemon does
    (a pass must mean the daemon can map); a step not reached fails the verdict."""
    lib = _fake_libcuda(tmp_path)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("", "client", "server"))}  # fmt: skip
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "fake_driver_run.py"),
                        "preflight"], env=env, capture_output=True, text=True, timeout=120,
                       check=False)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = re.findall(r"^preflight: ([\w-]+): (OK|FAILED|DEFECT)", r.stdout, re.M)
    names = [n for n, _ in steps]
    want = ["ipc-mem-open", "ipc-mem-ordinal", "ipc-mem-range", "ipc-mem-read"]
    assert [n for n in names if n in want] == want, r.stdout
    assert all(v == "OK" for _, v in steps), r.stdout
    assert "(GPU 0)" in r.stdout and "mapping at its base + 0" in r.stdout, r.stdout
    pf = _load(ROOT / "scripts" / "ipc_preflight.py", "ipc_preflight_t")
    out = "\n".join(ln for ln in r.stdout.splitlines() if "ipc-mem-range" not in ln)
    verdict, rc = pf.summarize(out, 0)
    assert rc == pf.EXIT_IPC_FAILED and "ipc-mem-range not reached" in verdict, verdict


def test_device_check_over_the_fake_driver_runs_every_stage_in_order(tmp_path: Path) -> None:
    """The whole script on this CPU over the fake libcuda (tests/gpu/fake_libcuda.c):
    the probe finds its "GPU", NVRTC builds the kernels for it, and every later stage
    gets its row, in the documented order; with no CUDA torch here the GPU tests skip
    (a failed row, not a silent pass) and the preflight has no engine side (SKIPPED,
    so is the daemon half)."""
    lib = _fake_libcuda(tmp_path)
    stages = [s for s in _stages() if s != "bench"]
    r = _run_script(
        tmp_path,
        STAGES=" ".join(stages),
        LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        KVSEAL_CACHE_DIR=str(tmp_path / "cache"),
        DEVICE_CHECK_BUDGET="240",
    )
    summary = (tmp_path / "out" / "summary.md").read_text()
    rows = re.findall(r"^\| (\w+) \| ([^|]+) \|", summary, re.M)[1:]  # past the header
    assert [name for name, _ in rows] == stages, summary + r.stderr[-2000:]
    got = {name: result.strip() for name, result in rows}
    assert got["probe"] == "ok" and "Fake H200" in summary, summary
    assert got["deps"] == "ok" and got["nvrtc"] == "ok", summary
    assert got["inprocess"] == "NO GPU TESTS RAN", summary
    assert got["preflight"] == got["daemon"] == "SKIPPED", summary
    assert r.returncode == 1, summary
