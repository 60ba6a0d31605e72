"""Prompt/completion data: two columns, ``prompt`` and ``completion``; the labels cover the
completion (and the eos after it) only, or every token.

Plain strings are joined as ``prompt + completion`` (no separator is added: put one in the data if
the model needs it) and tokenized once; conversational pairs (lists of messages, as TRL stores
them) are rendered with the chat template, the completion's assistant turns labelled.
"""

from __future__ import annotations

from typing import Any

from hf_tp.data.formats.chat import check_chat_tokenizer, encode_conversation, messages_problem, normalize_messages
from hf_tp.data.formats.spans import span_labels

PROMPT, COMPLETION = "prompt", "completion"


def describe_value(value: Any) -> str:
    """A row's value as a message names it: its type and the start of its text."""
    return "null" if value is None else f"{type(value).__name__} {repr(value)[:40]}"


def pair_problem(prompt: Any, completion: Any) -> str | None:
    """What makes a prompt/completion row unusable, or None: both strings (a non-empty completion)
    or both lists of role/content messages."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return None if completion.strip() else "the completion is empty"
    if isinstance(prompt, list) and isinstance(completion, list):
        return messages_problem(prompt) or messages_problem(completion)
    for name, value, other, kind in (
        ("completion", completion, prompt, PROMPT),
        ("prompt", prompt, completion, COMPLETION),
    ):
        if isinstance(other, str):
            return f"the {name} is {describe_value(value)}, not a string like the {kind}"
        if isinstance(other, list):
            return f"the {name} is {describe_value(value)}, not a list of messages like the {kind}"
    return (
        "prompt and completion must both be strings or both be lists of messages, got "
        f"{describe_value(prompt)} and {describe_value(completion)}"
    )


def encode_pair(
    tokenizer: Any, prompt: Any, completion: Any, *, completion_only: bool, where: str
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one prompt/completion pair."""
    problem = pair_problem(prompt, completion)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    if isinstance(prompt, str):
        text = prompt + completion
        start = len(prompt) if completion_only else 0
        ids, labels = span_labels(tokenizer, text, [(start, len(text))], where=where)
        eos = tokenizer.eos_token_id
        if eos is not None:
            ids, labels = ids + [eos], labels + [eos]
        return ids, labels
    check_chat_tokenizer(tokenizer)
    p, c = normalize_messages(prompt, where), normalize_messages(completion, where)
    first = len(p) if completion_only else 0
    return encode_conversation(tokenizer, p + c, assistant_only=completion_only, first=first, where=where)
