"""argparse's private names ``hf-tp``'s help and its generated flag tables use.

argparse documents only its classes' names; its formatter methods and a parser's action lists are
implementation details, stable for years. Light: imports argparse only (``hf-tp --help`` imports it).
"""

from __future__ import annotations

import argparse
from typing import Any

from hf_tp.compat.reaches import reaches, register

# what ArgumentParser.add_argument_group returns (argparse names no public class for it)
ArgumentGroup = argparse._ArgumentGroup
register(f"{__name__}.ArgumentGroup", "argparse:_ArgumentGroup")


@reaches("argparse:HelpFormatter._get_help_string")
class HelpTextFormatter(argparse.RawDescriptionHelpFormatter):
    """``RawDescriptionHelpFormatter`` whose flag help is :meth:`help_text` (argparse's hook for it
    is private); ``%(default)s`` in it is expanded as in any help."""

    def help_text(self, action: argparse.Action) -> str:
        """The help ``action`` shows; by default its own."""
        return super()._get_help_string(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        return self.help_text(action)


@reaches("argparse:ArgumentParser._get_formatter")
def formatter_of(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    """A new formatter of ``parser``'s ``formatter_class``, as ``--help`` uses."""
    return parser._get_formatter()


@reaches("argparse:ArgumentParser()._action_groups", "argparse:ArgumentParser()._actions")
def action_groups(parser: argparse.ArgumentParser) -> list[Any]:
    """``parser``'s argument groups, in the order ``--help`` lists them."""
    return parser._action_groups


@reaches("argparse:ArgumentParser()._actions")
def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every action (flag or positional) of ``parser``."""
    return parser._actions


@reaches(sets=("argparse:_ArgumentGroup._group_actions",))
def group_actions(group: Any) -> list[argparse.Action]:
    """The actions of one argument group."""
    return group._group_actions


@reaches("argparse:_HelpAction")
def is_help_action(action: argparse.Action) -> bool:
    """Whether ``action`` is ``-h/--help``."""
    return isinstance(action, argparse._HelpAction)


@reaches("argparse:HelpFormatter._format_action_invocation")
def invocation(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """A flag as ``--help`` lists it (``-t TP, --tp TP``)."""
    return formatter._format_action_invocation(action)


@reaches("argparse:HelpFormatter._expand_help")
def expanded_help(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """A flag's help as ``--help`` prints it (``%(default)s`` and the like filled in)."""
    return formatter._expand_help(action)
