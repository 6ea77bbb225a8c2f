"""Where this suite's ``LLM`` engines run: the one place that sets it for every
driver that builds one (driver.py's ``Engine``, so also test_store_engine.py's
driver; driver_evict.py; driver_family.py; driver_tp2.py, whose two ranks stay
worker processes).

vLLM's CPU platform runs an ``LLM`` as three processes: this script, a spawned
engine core (the scheduler) and a spawned worker (the mp executor, forced on
CPU while ``VLLM_ENABLE_V1_MULTIPROCESSING`` is on). Each spawn imports torch and
vLLM again, and the mp executor binds the worker's OpenMP threads to core 0 of
2, so engines started together compute on one core. With
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine core and the worker run in the
driver process: an engine starts about 3 times faster (15 s against 40 s, one
engine alone on this 2-core machine), and engines started together use both
cores.

What this keeps: the model, the KV cache, the scheduler, the worker and
kvseal's connector, spec, manager and worker are vLLM's and kvseal's own code,
against a real daemon over its socket and a KV buffer in real shared memory;
every run a test compares (with kvseal and without, anchor) runs this way, so
tokens are compared within the same settings. What it does not cover: the
engine core and worker as processes of their own. Tests of that keep it:
test_orphan.py, test_serve_command.py and the serving smoke start ``vllm
serve`` / the API server (one engine core process, one worker process), and
driver_tp2.py's two ranks are mp workers (TP=2 needs them).
"""

from __future__ import annotations

import os
from typing import Any

# The environment an engine of this suite's drivers starts under.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_engines_in_this_process() -> None:
    """Set :data:`ENGINE_ENV` in this process; call it before the first ``LLM``
    is built (vLLM's CPU platform reads it when it checks the config)."""
    os.environ.update(ENGINE_ENV)


def stop_engine(llm: Any) -> None:
    """Stop ``llm``'s engine and remove the KV shared-memory objects kvseal
    made for it in this process. The drivers end with ``os._exit`` (vLLM's
    atexit hooks can linger on 2 busy cores), which skips the atexit hook that
    would otherwise unlink them; with the worker in a process of its own, that
    process's exit ran it."""
    llm.llm_engine.engine_core.shutdown()
    unlink_kv_objects()


def unlink_kv_objects() -> None:
    """Remove the names of the KV shared-memory objects kvseal made in this
    process (idempotent; also for an engine whose start failed)."""
    from kvseal.core import shm_kv

    for a in shm_kv.allocations():
        a.unlink()
