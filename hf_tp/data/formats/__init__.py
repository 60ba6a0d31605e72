"""Data formats behind one interface: :func:`detect_format` picks the format of a dataset from its
columns (or the column flags), :func:`encode_batch` turns a ``datasets.map`` batch of raw rows
into documents of ``input_ids`` (and ``labels`` where some tokens are not targets).

One module per format: :mod:`.text` (a string column), :mod:`.chat` (a column of role/content
conversations, rendered with the chat template), :mod:`.completion` (``prompt``/``completion``).
Packing, the batch order and the loop never look at the format.
"""

from __future__ import annotations

from typing import Any

from hf_tp.data.formats.data_format import (
    CHAT,
    COMPLETION,
    DEFAULT_MESSAGES_COLUMN,
    DEFAULT_TEXT_COLUMN,
    IMAGES,
    PREFERENCE,
    TEXT,
    DataFormat,
)

__all__ = [
    "CHAT",
    "COMPLETION",
    "IMAGES",
    "PREFERENCE",
    "DEFAULT_MESSAGES_COLUMN",
    "DEFAULT_TEXT_COLUMN",
    "TEXT",
    "DataFormat",
]
__all__ += ["detect_format", "encode_batch"]


def detect_format(
    columns: list[str],
    *,
    text_column: str | None = None,
    messages_column: str | None = None,
    assistant_only: bool = True,
    label: str = "",
    seq_len: int | None = None,
) -> DataFormat:
    """The format of a dataset with ``columns``: an explicit ``--messages-column`` or
    ``--text-column`` wins; otherwise a ``text`` column means text, ``messages`` chat, and
    ``prompt`` + ``completion`` prompt/completion, ``chosen`` + ``rejected`` preference pairs
    (each side cut to ``seq_len``). Raises a one-line ``ValueError`` naming the
    columns and the flags when none fits."""
    from hf_tp.data.formats.completion import COMPLETION as COMPLETION_COLUMN
    from hf_tp.data.formats.completion import PROMPT
    from hf_tp.data.formats.preference import is_preference_data

    shown = ", ".join(columns)
    if text_column and messages_column:
        raise ValueError("pass either --text-column or --messages-column, not both")
    if not text_column and "images" in columns and (messages_column or DEFAULT_MESSAGES_COLUMN) in columns:
        return DataFormat(IMAGES, messages_column or DEFAULT_MESSAGES_COLUMN, assistant_only)  # formats.images
    for given, kind, flag in ((messages_column, CHAT, "--messages-column"), (text_column, TEXT, "--text-column")):
        if given:
            if given not in columns:
                what = "text" if kind == TEXT else "messages"
                raise ValueError(
                    f"{what} column '{given}' not in dataset {label}; its columns are: {shown}; pass {flag}"
                )
            return DataFormat(kind, given, assistant_only)
    if is_preference_data(columns):
        return DataFormat(PREFERENCE, None, True, seq_len)
    if DEFAULT_TEXT_COLUMN in columns:
        return DataFormat(TEXT, DEFAULT_TEXT_COLUMN, assistant_only)
    if DEFAULT_MESSAGES_COLUMN in columns:
        return DataFormat(CHAT, DEFAULT_MESSAGES_COLUMN, assistant_only)
    if PROMPT in columns and COMPLETION_COLUMN in columns:
        return DataFormat(COMPLETION, None, assistant_only)
    raise ValueError(
        f"text column 'text' not in dataset {label}; its columns are: {shown}; pass --text-column (documents) "
        "or --messages-column (conversations), or use prompt/completion (or prompt/chosen/rejected) columns"
    )


def encode_batch(
    fmt: DataFormat,
    batch: dict[str, list],
    indices: list[int],
    tokenizer: Any,
    label: str,
    *,
    skip: bool = False,
    places: Any = None,
) -> dict[str, list]:
    """Rows of a ``datasets.map(batched=True, with_indices=True)`` batch -> documents (``input_ids``,
    and ``labels`` where some tokens are not targets). A bad row raises a ``ValueError`` naming it
    (by ``places``, a :class:`hf_tp.data.places.RowPlaces`: by default the rows of the whole
    dataset ``label`` names), or with ``skip`` is dropped and recorded
    (:func:`hf_tp.data.formats.rows.encode_rows`)."""
    from hf_tp.data.formats.rows import encode_rows

    return encode_rows(fmt, batch, indices, tokenizer, label, skip, places)
