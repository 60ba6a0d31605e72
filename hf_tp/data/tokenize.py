"""Tokenizing a loaded dataset of any format into training rows (packed or one document per row)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import datasets

from hf_tp.data.formats import CHAT, PREFERENCE, TEXT, DataFormat, detect_format, encode_batch
from hf_tp.data.packing import pack_documents
from hf_tp.data.places import RowPlaces, split_total


def dataset_label(ds: datasets.Dataset) -> str:
    """How messages name ``ds``: its source when it came from ``load_text_dataset``."""
    return f"'{ds.info.dataset_name}'" if ds.info.dataset_name else "(in memory)"


def tokenize_dataset(
    ds: datasets.Dataset,
    tokenizer: Any,
    *,
    seq_len: int,
    text_column: str | None = None,
    pack: bool = True,
    fmt: DataFormat | None = None,
    document_masking: bool = True,
    keep_tail: bool = False,
    skip_bad_rows: bool = False,
    report: Callable[[str], None] | None = None,
) -> datasets.Dataset:
    """Tokenize ``ds`` into rows of ``input_ids`` (with ``labels`` where some tokens are no
    targets, and ``position_ids`` restarting per document when packed with ``document_masking``).

    The format (text, chat, prompt/completion) is ``fmt``, or detected from the columns
    (``text_column`` forces text). Each document ends with the tokenizer's eos where its format
    adds one. ``pack=True`` concatenates the documents in order into rows of exactly ``seq_len``
    tokens (:func:`hf_tp.data.packing.pack_documents`; ``keep_tail`` keeps the last, shorter row:
    evaluation sets lose no token); ``pack=False`` keeps one row per
    document, truncated to ``seq_len`` (a truncated document loses its eos).

    A malformed row (:func:`hf_tp.data.formats.rows.row_problem`, or one the chat template rejects)
    raises a ``ValueError`` naming it; with ``skip_bad_rows`` it is dropped, and ``report`` gets one
    line saying how many and which.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got seq_len={seq_len}")
    label = dataset_label(ds)
    fmt = fmt or detect_format(ds.column_names, text_column=text_column, label=label)
    if fmt.kind == PREFERENCE:  # pairs are never packed: each side is one row, cut to seq_len
        fmt, pack = dataclasses.replace(fmt, seq_len=seq_len), False
    if fmt.kind == TEXT:
        check_string_column(ds.features.get(fmt.column), fmt.column, label)
    if fmt.kind == CHAT:
        _check_chat_tokenizer(tokenizer, ds.column_names)
    places = RowPlaces(label, str(ds.split) if ds.split else None, split_total(ds))  # names a bad row
    try:
        docs = ds.map(
            lambda batch, idx: encode_batch(fmt, batch, idx, tokenizer, label, skip=skip_bad_rows, places=places),
            batched=True,
            with_indices=True,
            remove_columns=ds.column_names,
            desc="Tokenizing",
        )
    except UnicodeDecodeError as exc:  # the json reader does not check UTF-8: a local file's line is named
        from hf_tp.data.row_checks import check_readable

        if ds.info.dataset_name:
            check_readable(ds.info.dataset_name, str(exc))
        raise ValueError(f"dataset {label} holds text that is not UTF-8 ({exc})") from None
    if skip_bad_rows:
        docs = _drop_skipped(docs, label, report)
    docs.info.dataset_name = ds.info.dataset_name
    if fmt.kind == PREFERENCE:
        return _pairs_truncated(docs, label, seq_len, report)
    if pack:
        return pack_documents(docs, seq_len, document_masking=document_masking, label=label, keep_tail=keep_tail)
    if len(docs) == 0:
        column = fmt.column or "prompt/completion"
        raise ValueError(f"dataset {label} has no tokens: every row of text column '{column}' is empty")
    return docs.map(
        lambda batch: {k: [v[:seq_len] for v in values] for k, values in batch.items()},
        batched=True,
        desc="Truncating",
    )


def _check_chat_tokenizer(tokenizer: Any, columns: list[str]) -> None:
    """Chat data needs a chat template, and one that reads ``tools`` where the rows carry tools."""
    from hf_tp.data.formats.chat import check_chat_tokenizer
    from hf_tp.data.formats.tools import TOOLS_COLUMN, check_tools_template

    check_chat_tokenizer(tokenizer)
    if TOOLS_COLUMN in columns:
        check_tools_template(tokenizer)


def _pairs_truncated(
    docs: datasets.Dataset, label: str, seq_len: int, report: Callable[[str], None] | None
) -> datasets.Dataset:
    """Preference pairs (already cut to ``seq_len``): ``report`` hears in one line how many were cut."""
    cut = sum(docs["truncated"])
    if cut and report is not None:
        pairs = "pair" if len(docs) == 1 else "pairs"
        report(
            f"hf-tp: {cut} of {len(docs)} preference {pairs} of dataset {label} cut to --seq-len {seq_len} "
            "tokens per side (the end of the completion dropped, as TRL's keep_start)"
        )
    return docs.remove_columns("truncated")


def _drop_skipped(docs: datasets.Dataset, label: str, report: Callable[[str], None] | None) -> datasets.Dataset:
    """``docs`` without the rows :func:`encode_batch` dropped; ``report`` hears which, once."""
    from hf_tp.data.formats.rows import SKIPPED, skipped_summary

    lines = [line for line in docs[SKIPPED] if line]
    if lines and len(lines) == len(docs):
        raise ValueError(f"--skip-bad-rows would drop every row of dataset {label}; the first: {lines[0]}")
    if lines:
        docs = docs.filter(lambda why: not why, input_columns=SKIPPED, desc="Dropping bad rows")
        if report is not None:
            report(skipped_summary(lines, label))
    return docs.remove_columns(SKIPPED)


def check_string_column(feature: Any, column: str, label: str) -> None:
    """The text column's ``feature`` (None: unknown) holds strings; a column of mixed values
    (``Json``: strings and nulls or numbers) is checked row by row."""
    if feature is None or isinstance(feature, datasets.Json):
        return
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ValueError(f"text column '{column}' of dataset {label} holds {feature}, not strings; pass --text-column")
