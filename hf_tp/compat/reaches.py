"""Where each compat function registers the private names it reaches, for :mod:`hf_tp.compat.probes`.

A compat function is decorated with ``@reaches("torch.distributed.device_mesh:DeviceMesh._flatten")``:
the module to import, a colon, then the attributes to follow (``Name()`` makes an instance without
arguments there, for attributes an object gets in its ``__init__``). ``sets=("mod:Class._attr",)``
names an attribute the class sets on its instances where none is cheap to make (probed in the
class's source); ``check=`` adds a probe of behaviour (returns what broke, or None) for what a name
alone cannot show. Light: imports nothing of torch, transformers or peft (the probes import what
they check when they run).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Reach:
    """One private name a compat function (``owner``) reaches. ``check``: a probe of behaviour
    (returning what broke, or None); ``sets``: ``path`` is ``mod:Class.attr``, an attribute the class
    sets on its instances."""

    path: str
    owner: str
    check: Callable[[], str | None] | None = None
    sets: bool = False

    @property
    def package(self) -> str:
        """The top-level package the name belongs to (``torch``, ``transformers``, ``peft``, ``argparse``...)."""
        return self.path.split(":", 1)[0].split(".", 1)[0]

    @property
    def dotted(self) -> str:
        """The name as one dotted path (``torch.distributed.device_mesh.DeviceMesh._flatten``)."""
        return self.path.replace(":", ".")


REACHES: list[Reach] = []


def _entries(owner: str, paths: Iterable[str], sets: Iterable[str], check) -> list[Reach]:
    out = [Reach(path, owner) for path in paths] + [Reach(path, owner, sets=True) for path in sets]
    if check is not None:
        out.append(Reach(out[0].path, owner, check))
    return out


def reaches(*paths: str, sets: tuple[str, ...] = (), check: Callable[[], str | None] | None = None) -> Callable[[T], T]:
    """Register the private names ``paths`` (``module:Attr.attr``) and instance attributes ``sets``
    (``module:Class.attr``) the decorated function or class reaches, and ``check`` (a probe of its
    behaviour, run after the names resolve)."""

    def register_owner(owner: T) -> T:
        REACHES.extend(_entries(f"{owner.__module__}.{owner.__qualname__}", paths, sets, check))
        return owner

    return register_owner


def register(
    owner: str, *paths: str, sets: tuple[str, ...] = (), check: Callable[[], str | None] | None = None
) -> None:
    """:func:`reaches` for a module-level name of a compat module (``owner``: its dotted name), where
    no decorator fits (a type alias, a constant)."""
    REACHES.extend(_entries(owner, paths, sets, check))


def missing(path: str) -> str | None:
    """What of ``path`` does not resolve on the installed release (``X is gone`` for its first part
    that does not, or the error importing its module), or None when all of it does."""
    module, _, chain = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        gone = exc.name or ""
        if not (module == gone or module.startswith(gone + ".")):
            return f"{module} cannot be imported ({type(exc).__name__}: {exc})"
        return f"{gone} is gone"  # (the module, or the package above it)
    except ImportError as exc:
        return f"{module} cannot be imported ({type(exc).__name__}: {exc})"
    done = module
    for part in chain.split(".") if chain else ():
        name = part.removesuffix("()")
        if not hasattr(obj, name):
            return f"{done}.{name} is gone"
        obj, done = getattr(obj, name), f"{done}.{name}"
        if part.endswith("()"):
            obj, done = obj(), f"{done}()"
    return None


def defines(path: str) -> str | None:
    """The probe of a ``sets`` entry ``mod:Class.attr``: None if the class (or a base) still sets
    ``attr`` on its instances (``self.attr = ...`` or ``self.attr: T = ...`` in its source, or a class
    annotation), else what broke."""
    import inspect
    import re

    where, _, attribute = path.rpartition(".")
    module, _, name = where.partition(":")
    cls = getattr(importlib.import_module(module), name)
    for klass in cls.__mro__:
        if attribute in getattr(klass, "__annotations__", {}):
            return None
        try:
            if re.search(rf"self\.{attribute}\s*(:[^=\n]+)?=(?!=)", inspect.getsource(klass)):
                return None
        except (OSError, TypeError):
            continue
    return f"{where.replace(':', '.')} no longer sets {attribute}"
