"""Plain-text data: one document per row of a string column; every token is a target."""

from __future__ import annotations

from typing import Any


def text_problem(value: Any, column: str) -> str | None:
    """What makes ``value`` not a document, or None (an empty string is a document without tokens)."""
    if isinstance(value, str):
        return None
    shown = "null (the key is missing or null)" if value is None else f"{type(value).__name__} {repr(value)[:40]}"
    return f"column '{column}' holds {shown}, not a string"


def encode_text_batch(batch: dict[str, list], tokenizer: Any, *, column: str) -> dict[str, list[list[int]]]:
    """A ``datasets.map`` batch of documents -> ``input_ids`` per document (no added special tokens,
    the tokenizer's eos appended when it has one); empty and whitespace-only documents are skipped."""
    texts = [text for text in batch[column] if text and not text.isspace()]
    if not texts:
        return {"input_ids": []}
    # verbose=False: documents longer than the model's context are expected before packing.
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return {"input_ids": [doc + [eos] if eos is not None else doc for doc in ids if doc]}
