"""kvseal's log lines inside vLLM, formatted as vLLM's own.

vLLM configures only its ``vllm`` logger (a handler with its format: process
name and pid, level, time, file and line); kvseal logs under ``kvseal``, which
has no handler, so without this a kvseal warning reaches Python's last-resort
handler and is printed as a bare message. :func:`use_vllm_handlers` gives the
``kvseal`` logger a handler that passes each record to the handlers the
``vllm`` logger has *at that moment* (vLLM may configure its logging after
kvseal is imported, and again), so kvseal's lines carry vLLM's format, stream,
level filter, JSON formatter included.

No line is printed twice: the handler does nothing while the root logger has
handlers (an application that configured logging gets kvseal's lines through
propagation, as before), nor while the ``vllm`` logger has none
(``VLLM_CONFIGURE_LOGGING=0``): then a warning goes to Python's last-resort
handler, as it did before. A ``kvseal`` logger that already has handlers of
its own (configured by the operator) is left alone.
"""

from __future__ import annotations

import logging
import os

_NAME = "kvseal"


class _ToVllmHandlers(logging.Handler):
    """Hands kvseal's records to the ``vllm`` logger's current handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the root logger prints it (propagation): once is enough
        handlers = logging.getLogger("vllm").handlers
        if not handlers:
            last = logging.lastResort
            if last is not None and record.levelno >= last.level:
                last.handle(record)
            return
        for h in handlers:
            if record.levelno >= h.level:
                h.handle(record)


def use_vllm_handlers() -> None:
    """Route the ``kvseal`` logger's records to vLLM's handlers (module doc).
    Idempotent. The ``kvseal`` logger's level, if unset, becomes vLLM's
    (``VLLM_LOGGING_LEVEL``, default INFO) unless the root logger has
    handlers, so its INFO lines (a pool registered again, calls succeeding
    again) show where vLLM's do."""
    logger = logging.getLogger(_NAME)
    if any(isinstance(h, _ToVllmHandlers) for h in logger.handlers):
        return
    if logger.handlers:
        return  # configured by the operator: theirs
    logger.addHandler(_ToVllmHandlers())
    # Not when the application configured the root logger: its handlers would
    # then print kvseal's INFO lines, which its own levels used to drop.
    if logger.level == logging.NOTSET and not logging.getLogger().handlers:
        level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
        logger.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")
