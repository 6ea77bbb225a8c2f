"""kvseal's log lines inside vLLM carry vLLM's format, once.

A subprocess applies vLLM's own logging configuration (as its CLI does),
imports the adapter the way vLLM does (``kv_connector_module_path``), and
makes kvseal log a real warning: an ``EnginePool`` whose daemon is not there
fails to register. Its line must read like vLLM's own, ``(<process> pid=<pid>)
WARNING <MM-DD HH:MM:SS> [<file>:<line>] <message>``, and appear exactly once;
with handlers on the root logger (an application that configured logging) it
appears once, through them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

CHILD = """
import argparse, logging, sys
if sys.argv[1] == "root":
    logging.basicConfig(stream=sys.stdout, format="ROOT %(levelname)s %(name)s %(message)s")
from vllm.logger import configure_logging_from_args
configure_logging_from_args(argparse.Namespace())  # vLLM's handler and format, as its CLI
import kvseal.vllm.connector  # noqa: F401 - what vLLM imports (kv_connector_module_path)
from kvseal.client import ClientConfig, EnginePool, KVSealClient
from kvseal.v1 import kvseal_pb2 as pb
client = KVSealClient(ClientConfig(target="unix:///nonexistent/kvseal.sock", timeout_s=0.5))
g = pb.PoolGeometry(num_pages=1, tokens_per_page=32, num_layers=1, num_kv_heads=1, head_dim=8,
                    dtype="bfloat16", layout="L,KV,T,H,D")
pool = EnginePool(client, "logging-test", b"fp", g)
assert pool.wait_ready(2) is None  # no daemon: the registration fails and is logged
pool.close()
"""

WARNING = "kvseal: registering pool logging-test failed"


def _run(mode: str) -> list[str]:
    """The lines of the child's output that carry the warning."""
    p = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "NO_COLOR": "1"},
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    return [line for line in out.splitlines() if WARNING in line]


def test_kvseal_warning_has_vllms_format() -> None:
    lines = _run("vllm")
    assert len(lines) == 1, lines
    m = re.match(
        r"\((\S+) pid=(\d+)\) WARNING \d\d-\d\d \d\d:\d\d:\d\d \[engine_pool\.py:\d+\] ", lines[0]
    )
    assert m is not None, lines[0]


def test_root_handlers_print_it_once() -> None:
    lines = _run("root")
    assert len(lines) == 1, lines
    assert lines[0].startswith("ROOT WARNING kvseal.client " + WARNING), lines[0]
