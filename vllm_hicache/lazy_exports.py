"""Public names of a package loaded on first use (PEP 562).

A package whose public names live in heavy submodules (torch) and light ones
(pure name lists that ``config.py`` needs) re-exports them lazily, so that
importing the light ones never imports the heavy ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str],
                 module_globals: Mapping[str, Any]) -> tuple[Callable[[str], Any],
                                                               Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``homes`` maps each
    public name to the submodule that defines it."""

    def getattr_(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home}"), name)

    def dir_() -> list[str]:
        return sorted(set(module_globals) | set(homes))

    return getattr_, dir_
