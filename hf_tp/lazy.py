"""Packages whose public names are imported on first use (``hf-tp --help`` must not load torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, names: dict[str, str | tuple[str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``names`` maps a public name to the module that
    defines it, or to ``(module, attribute)`` when it is called otherwise there."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = names[name]
        module, attr = (where, name) if isinstance(where, str) else where
        return getattr(importlib.import_module(module), attr)

    return __getattr__
