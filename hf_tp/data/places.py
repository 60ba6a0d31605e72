"""Where a row of a dataset is, in the words a person looks it up with: ``line N of FILE`` for local
JSON-lines, text and CSV files (the line an editor shows and ``sed -n Np FILE`` prints: counted
from 1, blank lines and a CSV header included), ``row N of FILE`` for local parquet files, and
``row N of dataset 'NAME'`` (counted from 1) for the rest (Hub datasets, datasets in memory).

``datasets`` numbers rows from 0 and a file's rows are not its lines one to one (the JSON-lines
reader skips blank lines, the CSV reader its header and blank lines, a quoted CSV field can span
lines, a split can be a slice), so the line is found by reading the files again: once, and only
when a message names a row.
"""

from __future__ import annotations

import csv
import functools
from array import array
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_tp.data.files import files_with_rows

_LINE_BUILDERS = ("json", "text", "csv")


@dataclass(frozen=True)
class RowPlaces:
    """Names row ``index`` (0-based, of the dataset as loaded) of the dataset that messages call
    ``label`` (``'SOURCE'``, or ``(in memory)``): ``places(3) == "line 5 of data.jsonl"``.

    ``split`` is the split as loaded (a slice such as ``train[10%:]`` shifts the rows); ``total``
    is the number of rows of the whole split as its builder counted them, where known: a count of
    the files' rows that disagrees with it falls back to ``row N of dataset``. Plain data, so a
    ``datasets.map`` function holding one hashes the same in every run."""

    label: str
    split: str | None = None
    total: int | None = None

    @property
    def source(self) -> str | None:
        """The dataset's name (a path or a Hub id), or None for a dataset in memory."""
        quoted = len(self.label) >= 2 and self.label[0] == self.label[-1] == "'"
        return self.label[1:-1] if quoted else None

    def __call__(self, index: int) -> str:
        files = _file_rows(self.source) if self.source else None
        if files is not None and any(f.rows is None for f in files):
            files = None  # (a file whose rows cannot be counted: no file is named)
        counted = sum(f.rows for f in files) if files is not None else None
        if None not in (counted, self.total) and counted != self.total:
            files = None  # the files were read differently from how the builder read them
        index = absolute_row(index, self.split, self.total if self.total is not None else counted)
        if files is not None:
            for f in files:
                if index < f.rows:
                    return f.place(index)
                index -= f.rows
        return f"row {index + 1} of dataset {self.label}"


def split_total(ds: Any) -> int | None:
    """Rows of the whole split that ``ds`` (a ``datasets.Dataset``) was loaded from, or None when
    unknown (a dataset built in memory, a split of several parts)."""
    names = _split_names(str(ds.split)) if getattr(ds, "split", None) else set()
    splits = ds.info.splits or {}
    if len(names) != 1 or next(iter(names)) not in splits:
        return None
    return splits[next(iter(names))].num_examples


def absolute_row(index: int, split: str | None, total: int | None) -> int:
    """Row ``index`` of a slice (``train[100:]``, ``train[:10%]+train[90%:]``) as a row of the whole
    split of ``total`` rows; ``index`` itself where there is no slice or it cannot be resolved."""
    if not split or total is None or "[" not in split:
        return index
    import datasets

    names = _split_names(split)
    if len(names) != 1:
        return index
    try:
        parts = datasets.ReadInstruction.from_spec(split).to_absolute({names.pop(): total})
    except (ValueError, AssertionError):
        return index
    for part in parts:
        if index < part.to - part.from_:
            return part.from_ + index
        index -= part.to - part.from_
    return index


def _split_names(split: str) -> set[str]:
    return {part.split("[")[0].strip() for part in split.split("+")}


class _LineMap:
    """The line of each row of one file, stored as the rows where ``line - row`` changes (a blank
    line, a CSV header, a multi-line field): a few numbers for a file of millions of rows."""

    def __init__(self) -> None:
        self.starts, self.offsets, self.rows = array("q"), array("q"), 0

    def add(self, line: int) -> None:
        """The next row is on ``line`` (1-based)."""
        if not self.offsets or self.offsets[-1] != line - self.rows:
            self.starts.append(self.rows)
            self.offsets.append(line - self.rows)
        self.rows += 1

    def line(self, row: int) -> int:
        return row + self.offsets[bisect_right(self.starts, row) - 1]


@dataclass(frozen=True)
class _FileRows:
    """One file's rows: how many (None: unknown), and the line of each where lines name them."""

    file: Path
    rows: int | None
    lines: _LineMap | None = None

    def place(self, row: int) -> str:
        if self.lines is None:
            return f"row {row + 1} of {self.file}"
        return f"line {self.lines.line(row)} of {self.file}"


def _file_rows(source: str) -> list[_FileRows] | None:
    """The files of local dataset ``source`` with their rows, or None where it is not local."""
    path = Path(source).expanduser()
    return _files_of(source, *_stamp(path)) if path.exists() else None


@functools.lru_cache(maxsize=16)
def _files_of(source: str, size: int, mtime_ns: int) -> list[_FileRows] | None:
    """Once per version of ``source`` (a directory's time changes with its list of files): with
    ``--skip-bad-rows`` every dropped row is named."""
    found = files_with_rows(source)
    if found is None:
        return None
    builder, files = found
    return [_rows_of(builder, str(f), *_stamp(f)) for f in files]


def _stamp(file: Path) -> tuple[int, int]:
    stat = file.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _rows_of(builder: str, name: str, size: int, mtime_ns: int) -> _FileRows:
    """Read once per version of a file (its size and time are part of the key)."""
    file = Path(name)
    if builder == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return _FileRows(file, pq.read_metadata(file).num_rows)
        except (pa.ArrowException, OSError):
            return _FileRows(file, None)
    if builder not in _LINE_BUILDERS:
        return _FileRows(file, None)
    lines = _LineMap()
    try:
        for line in {"json": _json_lines, "text": _text_lines, "csv": _csv_lines}[builder](file):
            lines.add(line)
    except (OSError, csv.Error, _NotJsonLines):
        return _FileRows(file, None)
    return _FileRows(file, lines.rows, lines)


class _NotJsonLines(Exception):
    """A .json file that is one JSON document (``[...]``, a pretty-printed object): no line per row."""


def _json_lines(file: Path) -> Iterator[int]:
    """The line of each row of a JSON-lines file: each line that is not blank (the reader skips those)."""
    with open(file, "rb") as f:
        for number, line in enumerate(f, start=1):
            text = line.removeprefix(b"\xef\xbb\xbf") if number == 1 else line
            if text.strip():
                if not text.lstrip().startswith(b"{"):
                    raise _NotJsonLines
                yield number


def _text_lines(file: Path) -> Iterator[int]:
    """The line of each row of a text file: every line, blank ones included (the text builder
    splits at "\\n", "\\r\\n" and a lone "\\r", ``sed`` only at "\\n")."""
    number = 1
    with open(file, encoding="utf-8", errors="replace", newline="") as f:
        for row in f:
            yield number
            number += row.endswith("\n")


def _csv_lines(file: Path) -> Iterator[int]:
    """The line of each row of a CSV file, where the record starts: the header (the first record
    that is not blank) and blank lines are no rows; a quoted field can span lines."""
    consumed: list[str] = []

    def lines() -> Iterator[str]:
        with open(file, encoding="utf-8", errors="replace", newline="") as f:
            for line in f:
                consumed.append(line)
                yield line

    number, header = 1, True
    for _ in csv.reader(lines()):
        raw, start = "".join(consumed), number
        number += sum(part.endswith("\n") for part in consumed)
        consumed.clear()
        if not raw.strip():
            continue
        if header:
            header = False
            continue
        yield start


def summarize_places(places: list[str], known: str = "") -> str:
    """Places in one phrase: ``["line 3 of a.jsonl", "line 7 of a.jsonl", "row 2 of b.parquet"]``
    -> ``"lines 3, 7 of a.jsonl; row 2 of b.parquet"``; "of ``known``" (what the message names
    already) is left out."""
    groups: dict[tuple[str, str], list[str]] = {}
    for place in places:
        kind, number, rest = place.split(" ", 2)
        groups.setdefault((kind, rest), []).append(number)
    parts = []
    for (kind, rest), numbers in groups.items():
        noun = kind if len(numbers) == 1 else f"{kind}s"
        parts.append(f"{noun} {', '.join(numbers)}{'' if rest == f'of {known}' else ' ' + rest}")
    return "; ".join(parts)
