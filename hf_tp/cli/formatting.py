"""How every ``hf-tp`` parser prints its help: examples kept as written, every flag's default shown."""

from __future__ import annotations

import argparse

from hf_tp.compat.argparse_private import HelpTextFormatter


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


def add_model_and_layout(p: argparse.ArgumentParser, *, dp: bool = False, ep_cp: bool = True) -> None:
    """``--model`` as ``hf-tp estimate`` resolves it, offline, and the layout sizes ``--tp``,
    ``--ep``, ``--cp`` (and ``--dp``): shared by ``hf-tp plan`` and ``hf-tp verify`` (which takes
    ``--ep`` and ``--cp`` as ``hf-tp train`` does, from its settings: ``ep_cp=False``)."""
    from hf_tp.core.model_source import bundled_models  # json files only: no torch for --help

    names = ", ".join(bundled_models())
    p.add_argument("--model", required=True, help=f"bundled short name ({names}), local dir/config.json, or Hub id")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    if dp:
        p.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP2) size")
    if ep_cp:
        p.add_argument("--ep", type=int, default=1, help="expert-parallel size for MoE models (ranks borrowed from dp)")
        p.add_argument("--cp", type=int, default=1, help="context-parallel size: each row's tokens split over cp ranks")
