"""How every ``hf-tp`` parser prints its help: examples kept as written, every flag's default shown."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Mapping
from dataclasses import Field, fields
from typing import Any

from hf_tp.compat.argparse_private import ArgumentGroup, HelpTextFormatter
from hf_tp.core.setting import flags_of, value_types


class HelpFormatter(HelpTextFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already names its default (train's
    flags default to None so that a YAML file can set them: their help states the real default)."""

    def help_text(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.required:
            return f"{text} (required)"
        if action.default is None:
            return f"{text} (default: none)"
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def subcommand_parser(prog: str, doc: str | None, epilog: str) -> argparse.ArgumentParser:
    """A stand-alone parser for one subcommand (``python -m hf_tp.train``), formatted as ``hf-tp``'s."""
    return argparse.ArgumentParser(prog=prog, description=doc, epilog=epilog, formatter_class=HelpFormatter)


def add_model_flag(p: argparse.ArgumentParser) -> None:
    """``--model`` as ``hf-tp estimate`` resolves it, offline: shared by ``plan``, ``estimate`` and ``verify``."""
    from hf_tp.core.model_source import bundled_models  # json files only: no torch for --help

    names = ", ".join(bundled_models())
    p.add_argument("--model", required=True, help=f"bundled short name ({names}), local dir/config.json, or Hub id")


def add_dims_flags(
    p: argparse.ArgumentParser | ArgumentGroup,
    names: tuple[str, ...] | None = None,
    defaults: Mapping[str, tuple[Any, str]] | None = None,
) -> None:
    """The layout flags (``--tp``, ``--dp``, ``--ep``, ``--cp``, ``--dp-replicate``, ``--pp`` and the
    schedule's), generated from :class:`hf_tp.core.dims.ParallelDims`'s fields (their help, metavar,
    choices and default): ``names`` those fields only; ``defaults`` a command's own default for a
    field and why it differs, ``{"tp": (2, "a plan at tp 1 splits nothing")}``, said in its help."""
    from hf_tp.core.dims import ParallelDims

    hints = typing.get_type_hints(ParallelDims)
    for f in fields(ParallelDims):
        if names is not None and f.name not in names:
            continue
        value, why = (defaults or {}).get(f.name, (f.default, ""))
        words = f"default {value}" + (f" here: {why}" if why else "")
        add_field_flags(p, f, value_types(hints[f.name]), default=value, default_words=words)


def add_field_flags(
    p: argparse.ArgumentParser | ArgumentGroup,
    f: Field,
    allowed: tuple[type, ...],
    *,
    default: Any = None,
    default_words: str | None = None,
) -> None:
    """One setting's flags (:class:`hf_tp.core.setting.Flags`): the one that sets it, a bool's
    ``--no-`` form, its presets; ``default`` the parsed value when no flag is given, ``default_words``
    what the help says of it (appended unless the help names its default)."""
    spec = flags_of(f)
    if spec.help is None and spec.no_help is None and not spec.presets:
        raise TypeError(f"setting {f.name} has no help text: pass setting(default, 'what it does', ...)")
    dashed = f.name.replace("_", "-")
    if spec.help is not None and spec.names is not None:
        names = spec.names or (f"--{dashed}",)
        words = default_words or f"default {f.default}"
        text = spec.help if "default" in spec.help else f"{spec.help} ({words})"
        if bool in allowed:
            p.add_argument(*names, dest=f.name, action="store_const", const=True, default=default, help=text)
        else:
            kind = int if int in allowed else float if float in allowed else None
            choices = list(spec.choices) if spec.choices else None
            p.add_argument(
                *names, dest=f.name, type=kind, metavar=spec.metavar, choices=choices, default=default, help=text
            )
    if spec.no_help is not None:
        if bool not in allowed:
            raise TypeError(f"setting {f.name}: a --no-{dashed} flag is for true/false settings")
        p.add_argument(f"--no-{dashed}", dest=f.name, action="store_const", const=False, help=spec.no_help)
    for flag, value, text in spec.presets:
        p.add_argument(flag, dest=f.name, action="store_const", const=value, help=text)
