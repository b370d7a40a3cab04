"""Where ``DTensor.__torch_function__`` sends a call: the seam that keeps the imports one-way.

A DTensor answers every torch function through handlers that need the DTensor class
themselves: the attribute-level handlers of :mod:`hp_dtensor._attributes` (shape, ``.grad``,
``backward``, ...) and the rule-driven op dispatch of :mod:`hp_dtensor._dispatch`. Those
modules import :mod:`hp_dtensor.dtensor` and install their handlers here when they are
imported; ``dtensor.py`` imports only this module, so no import cycle runs through the class.
``hp_dtensor/__init__`` imports both installers, and Python runs a package's ``__init__``
before any of its submodules, so they are in place before any DTensor exists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Handler", "install_dispatch", "install_special", "route"]

#: A handler: ``(func, args, kwargs) -> result``, as ``__torch_function__`` receives them.
Handler = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]

_SPECIAL: dict[Any, Handler] = {}
_DISPATCH: list[Handler] = []


def install_special(handlers: Mapping[Any, Handler]) -> None:
    """Answer each torch function of ``handlers`` with its handler, before any sharding rule."""
    _SPECIAL.update(handlers)


def install_dispatch(dispatch: Handler) -> None:
    """Send every other torch function to ``dispatch`` (the sharding-rule dispatch)."""
    _DISPATCH[:] = [dispatch]


def route(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on DTensor arguments: its special handler if it has one, else dispatch."""
    special = _SPECIAL.get(func)
    if special is not None:
        return special(func, args, kwargs)
    if not _DISPATCH:
        raise RuntimeError(
            f"{func} was called on a DTensor before hp_dtensor's op dispatch was installed; "
            "import hp_dtensor (its __init__ installs it) before building DTensors"
        )
    return _DISPATCH[0](func, args, kwargs)
