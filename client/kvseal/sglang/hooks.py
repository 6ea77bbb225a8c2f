"""Tell the kvseal linker each request's ``cache_salt`` (SGLang 0.5.23).

SGLang's ``UnifiedCacheLinker`` ABC passes the linker page hashes, device
slots and request ids, but not the request's namespace: its ``cache_salt``
reaches the hashes (it seeds their chain) but not the linker. kvseal needs it
as the tenant (per-tenant keys, crypto-erase, scoped statistics). So
:func:`install` wraps two methods of ``UnifiedRadixCache``:

- ``match_prefix(params)``: before it runs, the linker hears
  ``params.req.rid`` and ``params.key.cache_salt`` (its ``lookup``/``load`` of
  that request use that tenant) and makes it the current tenant;
- ``insert(params)``: the current tenant is ``params.key.cache_salt`` while it
  runs (the offloads SGLang issues from an insert, its write-through, are
  that request's pages).

Both run on the scheduler thread, as do the linker calls they bracket. The
wrappers do nothing but that when the cache's linker is a
:class:`~kvseal.sglang.linker.KVSealLinker`, and nothing at all otherwise.
Without the hooks (another SGLang whose methods differ: :func:`install`
logs why), every page is the shared tenant's; tenants stay apart anyway, since
the salt seeds SGLang's hashes, but lose their own keys and erasure.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvseal.sglang")

_state = {"installed": False}


def _linker_of(cache: Any) -> Any:
    wrapper = getattr(cache, "linker", None)
    linker = getattr(wrapper, "cache_linker", None)
    return linker if hasattr(linker, "note_request") else None


def _wrap_match(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def match_prefix(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        linker = _linker_of(self)
        if linker is not None:
            key = getattr(params, "key", None)
            req = getattr(params, "req", None)
            salt = getattr(key, "cache_salt", None)
            if req is not None:
                linker.note_request(req.rid, salt)
            else:
                linker.current_tenant = linker.tenants.of(salt)
        return orig(self, params, *args, **kwargs)

    return match_prefix


def _wrap_insert(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def insert(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        linker = _linker_of(self)
        if linker is not None:
            key = getattr(params, "key", None)
            linker.current_tenant = linker.tenants.of(getattr(key, "cache_salt", None))
        return orig(self, params, *args, **kwargs)

    return insert


def install() -> bool:
    """Install the wrappers once per process. False (and a warning saying
    why) when this SGLang's ``UnifiedRadixCache`` is not the one they fit."""
    if _state["installed"]:
        return True
    try:
        from sglang.srt.mem_cache.unified_radix_cache import (  # noqa: PLC0415
            UnifiedRadixCache,
        )
    except ImportError as e:
        log.warning("kvseal: no UnifiedRadixCache (%s): every page is the shared tenant's", e)
        return False
    for name in ("match_prefix", "insert"):
        fn = getattr(UnifiedRadixCache, name, None)
        params = list(inspect.signature(fn).parameters) if callable(fn) else []
        if params[:2] != ["self", "params"]:
            log.warning(
                "kvseal: UnifiedRadixCache.%s is not (self, params) in this SGLang: "
                "cache_salt is not passed to kvseal, every page is the shared tenant's",
                name,
            )
            return False
    UnifiedRadixCache.match_prefix = _wrap_match(UnifiedRadixCache.match_prefix)
    UnifiedRadixCache.insert = _wrap_insert(UnifiedRadixCache.insert)
    _state["installed"] = True
    return True
