"""One setting of a training run, declared once: its default, help text and command-line flags live
on the dataclass field (``setting``), so ``hf-tp train``'s parser, its ``--help`` and the flag table
of docs/training.md are all generated from the fields; plus the value types a setting may hold and
how a YAML value is converted to them."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flags:
    """How a field appears on the command line (its ``dataclasses.field`` metadata, key "flags").

    ``help`` is the field's help; it becomes the help of the flag that sets the field (for a bool,
    the flag that turns it on, ``--name``); a help text that does not say its default gets the real
    one appended (the profiles' values for the fields a profile fills). ``names``: the option
    strings of that flag, ``--field-name`` when empty; ``None``: no such flag. ``no_help``: a bool's
    ``--no-NAME`` flag, turning it off. ``presets``: further flags that set a fixed value,
    ``(flag, value, help)``. ``metavar`` and ``choices`` go to argparse as they are."""

    help: str | None
    names: tuple[str, ...] | None = ()
    no_help: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    presets: tuple[tuple[str, Any, str], ...] = ()


def setting(
    default: Any,
    help: str | None = None,  # noqa: A002 - argparse's word for it
    *,
    names: tuple[str, ...] | None = (),
    no_help: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    presets: tuple[tuple[str, Any, str], ...] = (),
) -> Any:
    """A dataclass field of a training setting with its flags (:class:`Flags`): adding a flag to
    ``hf-tp train`` is adding one such field to a group of ``hf_tp.run.settings_*``."""
    flags = Flags(help, names, no_help, metavar, choices, presets)
    return dataclasses.field(default=default, metadata={"flags": flags})


def flags_of(f: dataclasses.Field) -> Flags:
    """A field's :class:`Flags`; a field declared without :func:`setting` has none."""
    try:
        return f.metadata["flags"]
    except KeyError:
        raise TypeError(f"setting {f.name} is declared without hf_tp.core.setting.setting(...)") from None


def value_types(hint: Any) -> tuple[type, ...]:
    """A field's value types, ``None`` left out: ``int | None`` -> ``(int,)``."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return tuple(a for a in (typing.get_args(hint) if union else (hint,)) if a is not type(None))


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def type_words(allowed: tuple[type, ...]) -> str:
    """``(int,)`` -> "an integer", for messages."""
    return " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in allowed)


def is_a(value: object, allowed: tuple[type, ...]) -> bool:
    """``isinstance`` where a bool is no integer and an integer is a float."""
    if isinstance(value, bool):
        return bool in allowed
    return any(isinstance(value, t) or (t is float and isinstance(value, int)) for t in allowed)


def coerce_setting(name: str, value: Any, allowed: tuple[type, ...], where: str) -> Any:
    """A YAML value converted to a field's type, or one line naming the key.

    PyYAML follows YAML 1.1, where ``1e-3`` and ``3e4`` (no dot) are strings, not numbers;
    numbers, and strings that spell one, become the field's int or float (an int only when whole:
    ``3e4`` -> 30000, ``2.5`` is refused for an integer). ``yes``/``true`` are already booleans;
    a list of names is the comma-separated string the flag takes (``report_to``, LoRA targets)."""
    if value is None or (isinstance(value, bool) and bool in allowed):
        return value
    if str in allowed:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return ",".join(value)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. profile_steps: 10
    elif isinstance(value, int) and not isinstance(value, bool):
        return value if int in allowed else float(value)
    elif isinstance(value, (str, float)):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and int in allowed and number.is_integer():
            return int(number)
        if number is not None and float in allowed:
            return number
    raise ValueError(f"{where}: {name} must be {type_words(allowed)}, got {value!r}")


def settings_group(
    source: type, title: str, module: str, titles: dict[str, str] | None = None, **defaults: Any
) -> type:
    """A settings group (a plain dataclass, for a config that mixes groups in) with the fields of
    the dataclass ``source``: the same names, types, help and flags, declared once there. ``title``:
    its flags' group in ``--help``, ``titles`` another for some fields (:func:`help_title`).
    ``defaults`` overrides a field's default for this group (None: unset, a profile fills it;
    the field's type then takes None too)."""
    made = []
    for f in dataclasses.fields(source):
        hint, default = f.type, defaults.get(f.name, f.default)
        if f.name in defaults and default is None and "None" not in str(hint):
            hint = f"{hint} | None"
        made.append((f.name, hint, dataclasses.field(default=default, metadata=f.metadata)))
    namespace = {"TITLE": title, "FIELD_TITLES": dict(titles or {})}
    group = dataclasses.make_dataclass(source.__name__ + "Settings", made, namespace=namespace)
    group.__module__ = module  # where its annotations are read (typing.get_type_hints)
    group.__doc__ = f"The settings of :class:`{source.__module__}.{source.__name__}`, as a group of flags."
    return group


def help_title(group: type, name: str) -> str:
    """The ``--help`` group of a settings group's field ``name``: the group's ``TITLE``, unless its
    ``FIELD_TITLES`` names another."""
    return getattr(group, "FIELD_TITLES", {}).get(name, group.TITLE)
