"""Chat data: a column of conversations (lists of ``{"role", "content"}`` messages), rendered with
the tokenizer's chat template; the labels cover the assistant turns only (or every token).

Where the assistant text is in the rendered string comes from the template itself: its
``{% generation %}`` blocks when it has them (transformers' ``render_jinja_template`` returns
their character spans), otherwise from renderings of the conversation's prefixes (the text up to
each assistant turn with the generation prompt, and up to the end of that turn), each checked to
be a prefix of the full rendering. The tokens come from one tokenization of the full rendering
(:func:`hf_tp.data.formats.spans.span_labels`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hf_tp.data.formats.spans import span_labels

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_chat_tokenizer(tokenizer: Any) -> None:
    """A tokenizer without a chat template cannot render conversations: say so before training."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer of --model has no chat template, which chat (messages) data needs; use a model "
            "whose tokenizer has one (an instruct/chat model) or set tokenizer.chat_template in its folder"
        )


def messages_problem(value: Any) -> str | None:
    """What makes ``value`` not a conversation (a list of role/content messages), or None."""
    if value is None:
        return "the conversation is null; it must be a non-empty list of {'role', 'content'} messages"
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        return (
            f"a conversation must be a non-empty list of {{'role', 'content'}} messages, got "
            f"{type(value).__name__} {repr(value)[:40]}"
        )
    for j, msg in enumerate(value):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str) or "content" not in msg:
            return (
                f"message {j} is not a {{'role': str, 'content': str}} mapping (got {repr(msg)[:80]}); chat data "
                "needs lists of role/content messages"
            )
        content = msg["content"]
        if not (isinstance(content, str) or (content is None and msg.get("tool_calls"))):
            return f"message {j} ({msg['role']}) has content {repr(content)[:40]}; it must be a string"
    return None


def normalize_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """The conversation as plain dicts, each with a string ``role`` and a string ``content`` (None
    allowed for an assistant turn that only calls tools). Keys that Arrow filled with None for
    rows that lack them are dropped, so templates test for them as they would in Python."""
    problem = messages_problem(value)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return [{k: v for k, v in msg.items() if v is not None or k == "content"} for msg in value]


def _render(tokenizer: Any, messages: list[dict], tools: list | None = None, **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, tools=tools, **kwargs)


def assistant_spans(
    tokenizer: Any, messages: list[dict], *, first: int = 0, where: str, tools: list | None = None
) -> tuple[str, list]:
    """The rendered conversation and the character spans of its assistant turns from message
    index ``first`` on (earlier turns are context: a prompt/completion pair's prompt). ``tools``:
    the row's tool schemas, which the template renders (:mod:`hf_tp.data.formats.tools`)."""
    template = tokenizer.get_chat_template()
    if _GENERATION_TAG.search(template) and first == 0:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, indices = render_jinja_template(
            conversations=[messages],
            chat_template=template,
            return_assistant_tokens_mask=True,
            tools=tools,
            **tokenizer.special_tokens_map,
        )
        text, spans = rendered[0], [tuple(s) for s in indices[0]]
        if text != _render(tokenizer, messages, tools):
            raise ValueError(f"{where}: the chat template renders differently with and without generation spans")
    else:
        text = _render(tokenizer, messages, tools)
        spans = []
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant" or i < first:
                continue
            before = _render(tokenizer, messages[:i], tools, add_generation_prompt=True)
            through = _render(tokenizer, messages[: i + 1], tools)
            if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
                raise ValueError(
                    f"{where}: the chat template renders the turns before assistant message {i} differently once "
                    "later turns follow, so the assistant text cannot be located; add {% generation %} blocks "
                    "around the assistant turns to the template, or pass --no-assistant-only-loss"
                )
            spans.append((len(before), len(through)))
    spans = [(a, b) for a, b in spans if b > a]
    if not spans:
        raise ValueError(
            f"{where}: the conversation has no assistant turn to learn from (roles: "
            f"{', '.join(m['role'] for m in messages)}); drop such rows or pass --no-assistant-only-loss"
        )
    return text, spans


def encode_conversation(
    tokenizer: Any, messages: list[dict], *, assistant_only: bool, first: int = 0, where: str, tools: list | None = None
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one conversation: labels on the assistant tokens only (their tool
    calls included, tool results not), or on all."""
    if assistant_only:
        text, spans = assistant_spans(tokenizer, messages, first=first, where=where, tools=tools)
    else:
        text = _render(tokenizer, messages, tools)
        spans = [(0, len(text))]
    return span_labels(tokenizer, text, spans, where=where)
