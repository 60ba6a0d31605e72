"""Tool-calling chat data: a ``tools`` column (TRL's name) next to the conversations, holding each
row's tool schemas (a list of JSON-schema function descriptions, or that list as a JSON string),
passed to the chat template with the row, as TRL's SFT does. Assistant turns with ``tool_calls``
and ``tool`` role turns are rendered by the template; the assistant-only labels cover the
assistant's tool-call tokens and not the tool results (:mod:`hf_tp.data.formats.chat`)."""

from __future__ import annotations

import json
import re
from typing import Any

TOOLS_COLUMN = "tools"
_USES_TOOLS = re.compile(r"\btools\b")


def tools_problem(value: Any) -> str | None:
    """What makes a row's ``tools`` value unusable (None or empty: the row has no tools), or None."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            return f"'tools' is a string but not JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        return f"'tools' must be a list of tool schemas (JSON objects), got {type(value).__name__} {repr(value)[:40]}"
    return None


def row_tools(value: Any) -> list[dict] | None:
    """The row's tool schemas for the template (None without tools), keys that Arrow filled with
    None for schemas that lack them dropped (a template tests for them as in Python)."""
    if value is None or value == "" or value == []:
        return None
    return _without_nulls(json.loads(value) if isinstance(value, str) else value)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def check_tools_template(tokenizer: Any) -> None:
    """A chat template that never reads ``tools`` would drop every row's tools silently: one line."""
    template = tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) else ""
    if not _USES_TOOLS.search(template):
        raise ValueError(
            "the dataset has a 'tools' column but the chat template of --model does not render tools (it never "
            "reads a 'tools' variable), so the model would train without seeing them; use a model whose template "
            "supports tools, or drop or rename the column"
        )
