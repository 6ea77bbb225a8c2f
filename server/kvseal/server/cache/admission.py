"""Request admission for the cache: a request runs only while the cache
serves, and is counted as in flight until it returns, so that ``close``
never unmaps memory a request still uses."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


class Admits(Protocol):
    """What :func:`request` needs of the object whose method it wraps."""

    _inflight: int
    _inflight_cv: Any  # threading.Condition

    def _check_serving(self) -> None: ...


def request(fn: F) -> F:
    """Admit a call only while serving (``_check_serving`` raises otherwise),
    and count it in ``_inflight`` until it returns (``_inflight_cv`` is
    notified on every change)."""

    @functools.wraps(fn)
    def wrapper(self: Admits, *args: Any, **kwargs: Any) -> Any:
        with self._inflight_cv:
            self._check_serving()
            self._inflight += 1
        try:
            return fn(self, *args, **kwargs)
        finally:
            with self._inflight_cv:
                self._inflight -= 1
                self._inflight_cv.notify_all()

    return cast(F, wrapper)
