"""kvseal.server.timers.Deferred: delayed callbacks on one thread."""

from __future__ import annotations

import threading

from kvseal.server.timers import Deferred


def test_callbacks_run_in_due_order_on_one_thread() -> None:
    d = Deferred("test-deferred")
    ran: list[tuple[str, int]] = []
    done = threading.Event()

    def note(name: str) -> None:
        ran.append((name, threading.get_ident()))
        if len(ran) == 3:
            done.set()

    # Delays far apart, so a slow machine between the calls cannot reorder them.
    d.call_later(2.0, note, "late")
    d.call_later(0.0, note, "now")
    d.call_later(1.0, note, "soon")
    assert done.wait(30)
    assert [name for name, _ in ran] == ["now", "soon", "late"]
    assert len({tid for _, tid in ran}) == 1 and ran[0][1] != threading.get_ident()
    d.close()


def test_a_failing_callback_does_not_stop_the_thread() -> None:
    d = Deferred("test-deferred")
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("boom")

    d.call_later(0.0, boom)
    d.call_later(0.0, done.set)
    assert done.wait(30)
    d.close()


def test_close_drops_pending_callbacks() -> None:
    d = Deferred("test-deferred")
    ran = threading.Event()
    d.call_later(3600, ran.set)
    assert d.pending() == 1
    d.close()
    assert d.pending() == 0
    d.call_later(0.0, ran.set)  # ignored after close
    assert d.pending() == 0 and not ran.is_set()
