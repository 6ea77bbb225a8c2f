"""A placeholder ``sgl_kernel`` for SGLang's CPU engine in the tests.

The registry has no CPU build of ``sgl_kernel`` (SGLang's compiled ops), and
SGLang imports it at start-up. The tests' tiny Llama, with torch-native
attention (chosen on a CPU without AMX), calls none of its ops: every name
resolves to a function that raises if it is ever called, so a test that did
reach one fails loudly instead of computing something else.
"""

from typing import Any

__version__ = "0.4.10"  # the release sglang 0.5.23 names


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"sgl_kernel.{name} called: the test placeholder has no ops")

    _missing.__name__ = name
    return _missing
