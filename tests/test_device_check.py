"""The periodic device check (``--device-check-interval``): a CUDA context lost
while the daemon is idle turns health NOT_SERVING and ends the daemon with exit
status 4, as a failure inside a request does, with no request sent.

The CUDA backend runs on the emulated device (``EmulatedDevice.lose_context``
stands in for an Xid or a GPU reset): the backend alone, a real daemon in this
process (``Daemon.create``: gRPC, the relay, the health service), and
``kvseal-server``'s ``main()`` as a process of its own.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

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
