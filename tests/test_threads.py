"""kvseal.server.threads: a FixedPool has all its workers, named for the kernel,
from construction to shutdown, whatever is submitted to it."""

from __future__ import annotations

import glob
import threading
from pathlib import Path

from kvseal.server.threads import FixedPool, name_os_thread


def kernel_names() -> list[str]:
    out = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            out.append(Path(comm).read_text().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return out


def test_a_fixed_pool_has_all_its_named_workers_whatever_the_load() -> None:
    pool = FixedPool(3, "kvseal-test")
    try:
        assert kernel_names().count("kvseal-test") == 3  # before any task
        # More concurrent tasks than workers: they queue, no worker is added.
        gate = threading.Event()
        futures = [pool.submit(gate.wait, 30) for _ in range(20)]
        assert kernel_names().count("kvseal-test") == 3
        gate.set()
        assert all(f.result(30) for f in futures)
        assert kernel_names().count("kvseal-test") == 3
    finally:
        pool.shutdown(wait=True)
    assert kernel_names().count("kvseal-test") == 0


def test_name_os_thread_names_the_calling_thread_only() -> None:
    seen: list[str] = []

    def run() -> None:
        name_os_thread("kvseal-a-very-long-name")  # the kernel keeps 15 bytes
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text())

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert seen == ["kvseal-a-very-l\n"]
    assert "kvseal-a-very-l" not in Path("/proc/self/comm").read_text()
