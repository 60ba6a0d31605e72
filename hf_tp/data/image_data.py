"""A run's image + text rows (:mod:`hf_tp.data.formats.images`): checked before launch, encoded
once (token ids and assistant-only labels; the images stay references, processed per batch by
:class:`hf_tp.data.formats.images.ImageBatchCollator`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from hf_tp.data.formats.images import (
    IMAGES,
    MESSAGES,
    clean_messages,
    encode_image_row,
    image_row_problem,
    load_row_images,
)
from hf_tp.data.formats.rows import SKIPPED
from hf_tp.data.places import RowPlaces


def dataset_dir(source: str) -> Path | None:
    """The folder relative image paths are read from: the dataset file's (or folder's), if local."""
    path = Path(source).expanduser()
    return (path if path.is_dir() else path.parent) if path.exists() else None


def check_image_rows(ds: datasets.Dataset, label: str, base_dir: Path | None) -> None:
    """Before launch: the first bad row (shape, image parts against images, a missing file) as one line naming it."""
    places = RowPlaces(label)
    for i, row in enumerate(ds.select_columns([MESSAGES, IMAGES])):
        problem = image_row_problem(row, base_dir)
        if problem is not None:
            raise ValueError(f"{places(i)}: {problem}")


def encode_image_dataset(
    ds: datasets.Dataset,
    processor: Any,
    *,
    seq_len: int,
    assistant_only: bool,
    label: str,
    base_dir: Path | None,
    skip: bool = False,
) -> tuple[datasets.Dataset, list[str]]:
    """``ds`` with ``input_ids`` and ``labels`` added (its ``messages`` and ``images`` kept for the
    collator), and the lines of the rows dropped. A bad row (:func:`check_image_rows`' problems,
    an image PIL or the processor rejects, a row over ``seq_len`` with its image tokens: image rows
    are never cut) raises one line naming it, or with ``skip`` is dropped and its line returned."""
    places = RowPlaces(label)
    placeholder = getattr(processor, "image_token", None)
    placeholder = placeholder if isinstance(placeholder, str) and placeholder else None

    def encode(row: dict, index: int) -> dict:
        where = places(index)
        try:
            return {**_encode(row, where), SKIPPED: ""}
        except ValueError as exc:
            line = str(exc) if str(exc).startswith(where) else f"{where}: {exc}"
        except Exception as exc:  # noqa: BLE001 - PIL and image processors raise many kinds
            line = f"{where}: the processor or PIL rejects it ({type(exc).__name__}: {exc})"
        if not skip:
            raise ValueError(line) from None
        return {"input_ids": [], "labels": [], SKIPPED: line}

    def _encode(row: dict, where: str) -> dict:
        problem = image_row_problem(row, base_dir, placeholder=placeholder)
        if problem is not None:
            raise ValueError(problem)
        images = load_row_images(row[IMAGES], base_dir)
        messages = clean_messages(row[MESSAGES])
        ids, labels = encode_image_row(processor, messages, images, assistant_only=assistant_only, where=where)
        if len(ids) > seq_len:
            raise ValueError(
                f"{len(ids)} tokens with its image tokens, over --seq-len {seq_len}; image rows are not cut: "
                "raise --seq-len or drop the row"
            )
        return {"input_ids": ids, "labels": labels}

    out = ds.map(encode, with_indices=True, desc="encoding image + text rows")
    dropped = [line for line in out[SKIPPED] if line]
    if dropped:
        out = out.filter(lambda line: not line, input_columns=[SKIPPED])
    return out.remove_columns(SKIPPED), dropped
