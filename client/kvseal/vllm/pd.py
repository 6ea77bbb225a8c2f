"""The sealed prefill/decode handoff (docs/pd.md), driven by vLLM's
``kv_transfer_params`` the way llm-d's routing sidecar drives NixlConnector.

The transport is the daemons' shared sealed store: the prefill instance's
daemon publishes every offloaded block (write-through, the store's default),
and the decode instance's daemon finds it by the decode's *own* block hashes
(salted per tenant, sealed with associated data binding deployment, model,
tenant and hash). Nothing here opens a listener.

- Prefill: a request whose params carry ``do_remote_decode`` finishes with
  :func:`finished_params`: ``do_remote_prefill`` for the decode plus a
  ``kvseal_handoff`` entry that holds counts only (never a key, a hash or a
  salt).
- Decode: a request whose params carry a ``kvseal_handoff`` entry
  (:func:`handoff_of`) gets a bounded wait: blocks its daemon does not hold yet
  (the prefill's publish may still be in flight) are asked about again, and
  the request is looked up again next step (vLLM's RETRY; the scheduler
  thread never blocks), until ``kvseal_pd_wait_ms`` (default 2000) after the
  request arrived. Then whatever hit is restored (verified by the daemon) and
  the rest is recomputed.

The params travel through the host (the proxy, the HTTP bodies): they are
never trusted for correctness, only to decide *whether* to wait. How long is
the decode's own configuration, so a forged or replayed handoff costs at most
one bound of waiting and then a recompute. The outcome of each handoff
request is counted (:data:`COUNTS`) and logged.

This module imports nothing of vLLM or of the adapter (the manager and the
connector both use it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("kvseal.vllm")

HANDOFF_KEY = "kvseal_handoff"
HANDOFF_VERSION = 1
DEFAULT_WAIT_MS = 2000
# A decode request never waits longer than this, whatever the configuration says
# (a scheduler slot held for minutes would look like a hang to the client).
MAX_WAIT_MS = 60_000

# Outcomes of the decode's handoff requests in this process (scheduler side):
# "requests", "hit_blocks" (restored from the handoff), "missed_blocks"
# (recomputed), "late" (requests whose wait ran to the bound with blocks
# still missing), "full" (every prompt block from the handoff), and on the
# prefill side "issued" (handoffs handed out).
COUNTS: dict[str, int] = dict.fromkeys(
    ("requests", "hit_blocks", "missed_blocks", "late", "full", "issued"), 0
)
_counts_lock = threading.Lock()


def _count(**kw: int) -> None:
    with _counts_lock:
        for k, v in kw.items():
            COUNTS[k] += v


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Prefill side: the request asks for its KV to be handed to a decode."""
    return bool(params) and params.get("do_remote_decode") is True  # type: ignore[union-attr]


def handoff_of(params: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Decode side: the request's handoff entry, or None when it has none (or
    one of a version this code does not know: then no wait, a plain lookup)."""
    if not params:
        return None
    h = params.get(HANDOFF_KEY)
    if isinstance(h, Mapping) and h.get("v") == HANDOFF_VERSION:
        return h
    return None


def wait_s(extra_config: Mapping[str, Any]) -> float:
    """The decode's bound on waiting for a handoff's blocks, in seconds
    (``kvseal_pd_wait_ms``, clamped to 0 .. :data:`MAX_WAIT_MS`)."""
    try:
        ms = float(extra_config.get("kvseal_pd_wait_ms", DEFAULT_WAIT_MS))
    except (TypeError, ValueError):
        ms = DEFAULT_WAIT_MS
    return min(max(ms, 0.0), MAX_WAIT_MS) / 1000.0


def handoff_deadline(params: Mapping[str, Any] | None, extra_config: Mapping[str, Any]) -> float:
    """``time.monotonic()`` until which a new request's absent blocks are asked
    about again: now plus :func:`wait_s` for a handoff request, else 0 (never)."""
    if handoff_of(params) is None:
        return 0.0
    return time.monotonic() + wait_s(extra_config)


def finished_params(
    params: Mapping[str, Any] | None,
    prompt_tokens: int,
    block_size: int,
    returned: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """Prefill side, at ``request_finished``: the params vLLM returns with the
    request's output. A request that asked for a remote decode gets the
    decode's params (``returned``, vLLM's own, merged under them); any other
    keeps ``returned``. Counts only: the decode finds its blocks by its own
    hashes, so nothing here could name another tenant's blocks."""
    if not wants_remote_decode(params):
        return returned
    _count(issued=1)
    out = dict(returned or {})
    out.update(
        do_remote_prefill=True,
        do_remote_decode=False,
        **{
            HANDOFF_KEY: {
                "v": HANDOFF_VERSION,
                "blocks": prompt_tokens // block_size if block_size > 0 else 0,
                "block_size": block_size,
                "prompt_tokens": prompt_tokens,
            }
        },
    )
    return out


class DecodeOutcomes:
    """The decode side's per-request record: a handoff request's outcome is
    counted once, at the scheduler's first final answer for it (vLLM asks
    again after a preemption; that is not a new handoff). Scheduler thread
    only."""

    def __init__(self) -> None:
        self._arrived: dict[str, float] = {}  # handoff request -> arrival
        self._done: set[str] = set()

    def arrived(self, req_id: str, params: Mapping[str, Any] | None) -> None:
        if handoff_of(params) is not None:
            self._arrived[req_id] = time.monotonic()

    def answered(
        self, req_id: str, prompt_tokens: int, block_size: int, hit_tokens: int, bound_s: float
    ) -> None:
        """The scheduler's final lookup answer: ``hit_tokens`` of the prompt's
        full blocks are already computed or will be loaded."""
        began = self._arrived.get(req_id)
        if began is None or req_id in self._done or block_size <= 0:
            return
        self._done.add(req_id)
        # vLLM computes the prompt's last token itself: the blocks before it count.
        want = max(prompt_tokens - 1, 0) // block_size
        hit = min(hit_tokens // block_size, want)
        waited = time.monotonic() - began
        late = hit < want and waited >= bound_s
        _count(
            requests=1,
            hit_blocks=hit,
            missed_blocks=want - hit,
            late=int(late),
            full=int(hit == want),
        )
        log.info(
            "kvseal: handoff request %s: %d of %d prompt blocks from the handoff%s "
            "(%.0f ms after arrival)",
            req_id,
            hit,
            want,
            "; the rest recomputed after the wait's bound" if late else "",
            waited * 1000,
        )

    def finished(self, req_id: str) -> None:
        self._arrived.pop(req_id, None)
        self._done.discard(req_id)
