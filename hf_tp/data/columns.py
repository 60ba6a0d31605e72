"""Columns under other names: ``--prompt-column``, ``--chosen-column``, ``--rejected-column`` and
``--tools-column`` name the dataset's columns that hold what the formats read as ``prompt``,
``chosen``, ``rejected`` (preference pairs, :mod:`hf_tp.data.formats.preference`) and ``tools``
(tool-calling chat, :mod:`hf_tp.data.formats.tools`). They are renamed to those names as the
dataset is loaded (a column that already has such a name, but was not chosen, is dropped), so
every format, row check and message downstream reads one set of names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STANDARD = ("prompt", "chosen", "rejected", "tools")  # each has a --NAME-column flag


def column_renames(given: Mapping[str, str | None]) -> dict[str, str]:
    """``{the dataset's column: the name the formats read}`` from ``{standard name: the column the
    flag names, or None}``; a flag that names its own default renames nothing."""
    return {column: name for name, column in given.items() if column and column != name}


def _plan(columns: list[str], renames: Mapping[str, str], label: str) -> tuple[list[str], dict[str, str]]:
    """(columns to drop, columns to rename) of a dataset with ``columns``; one line when a named
    column is missing."""
    for column, name in renames.items():
        if column not in columns:
            raise ValueError(
                f"--{name}-column names column '{column}', which dataset {label} does not have; its columns are: "
                f"{', '.join(columns)}"
            )
    targets = set(renames.values())
    return [c for c in columns if c in targets and c not in renames], dict(renames)


def rename_dataset(ds: Any, renames: Mapping[str, str], label: str, columns: list[str] | None = None) -> Any:
    """``ds`` (a ``datasets.Dataset`` or ``IterableDataset``; ``columns``: its column names where
    it does not know them) with the named columns renamed (:func:`column_renames`)."""
    if not renames:
        return ds
    drop, rename = _plan(list(columns if columns is not None else ds.column_names), renames, label)
    if drop:
        ds = ds.remove_columns(drop)
    return ds.rename_columns(rename)


def rename_row(row: dict, renames: Mapping[str, str], label: str) -> dict:
    """One raw row (a first row read before launch) with the named columns renamed."""
    if not renames:
        return row
    drop, rename = _plan(list(row), renames, label)
    return {rename.get(k, k): v for k, v in row.items() if k not in drop}
