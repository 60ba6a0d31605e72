"""Prompt/completion data: two columns, ``prompt`` and ``completion``; the labels cover the
completion (and the eos after it) only, or every token.

Plain strings are joined as ``prompt + completion`` (no separator is added: put one in the data if
the model needs it) and tokenized once; conversational pairs (lists of messages, as TRL stores
them) are rendered with the chat template, the completion's assistant turns labelled.
"""

from __future__ import annotations

from typing import Any

from hf_tp.data.formats.chat import check_chat_tokenizer, encode_conversation, normalize_messages
from hf_tp.data.formats.spans import span_labels

PROMPT, COMPLETION = "prompt", "completion"


def encode_pair(
    tokenizer: Any, prompt: Any, completion: Any, *, completion_only: bool, where: str
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one prompt/completion pair."""
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise ValueError(f"{where}: the completion is empty; drop such rows")
        text = prompt + completion
        start = len(prompt) if completion_only else 0
        ids, labels = span_labels(tokenizer, text, [(start, len(text))], where=where)
        eos = tokenizer.eos_token_id
        if eos is not None:
            ids, labels = ids + [eos], labels + [eos]
        return ids, labels
    if isinstance(prompt, list) and isinstance(completion, list):
        check_chat_tokenizer(tokenizer)
        p, c = normalize_messages(prompt, where), normalize_messages(completion, where)
        first = len(p) if completion_only else 0
        return encode_conversation(tokenizer, p + c, assistant_only=completion_only, first=first, where=where)
    raise ValueError(
        f"{where}: prompt and completion must both be strings or both be lists of messages, got "
        f"{type(prompt).__name__} and {type(completion).__name__}"
    )


def encode_completion_batch(
    batch: dict[str, list], tokenizer: Any, *, completion_only: bool, row0: int, label: str
) -> dict[str, list[list[int]]]:
    """A ``datasets.map`` batch of pairs -> ``input_ids`` and ``labels`` per row."""
    ids, labels = [], []
    for k, (prompt, completion) in enumerate(zip(batch[PROMPT], batch[COMPLETION], strict=True)):
        row_ids, row_labels = encode_pair(
            tokenizer, prompt, completion, completion_only=completion_only, where=f"row {row0 + k} of dataset {label}"
        )
        ids.append(row_ids)
        labels.append(row_labels)
    return {"input_ids": ids, "labels": labels}
