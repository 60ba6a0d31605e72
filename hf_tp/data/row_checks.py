"""Checks of every row of a local dataset, made before any rank starts: each row against its
format (types, missing keys, empty or null fields: no tokenizer needed) and the bytes of text
files against UTF-8. Each raises a one-line ``ValueError`` that names the row (or line).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import datasets

from hf_tp.data.formats import DataFormat
from hf_tp.data.formats.rows import row_problem


def check_all_rows(ds: datasets.Dataset, fmt: DataFormat, source: str, shown: int = 5) -> None:
    """One pass over every row of ``ds`` (the format's columns only, no tokenizer): raises a
    ``ValueError`` naming the first bad row, what is wrong with it, and how many others are bad."""
    columns = [c for c in (fmt.column, "prompt", "completion") if c in ds.column_names]
    bad: list[tuple[int, str]] = []
    index = 0
    for batch in ds.select_columns(columns).iter(batch_size=1000):
        for row in (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)):
            problem = row_problem(fmt, row)
            if problem is not None:
                bad.append((index, problem))
            index += 1
    if bad:
        (first, problem), others = bad[0], [str(i) for i, _ in bad[1:shown]]
        rows = "row" if len(bad) == 2 else "rows"
        more = f"; {len(bad) - 1} more bad {rows} ({', '.join(others)}{', ...' if len(bad) > shown else ''})"
        raise ValueError(
            f"row {first} of dataset '{source}': {problem}{more if others else ''}; fix it, or pass "
            "--skip-bad-rows to drop bad rows"
        )


def check_utf8(source: str, files: list[Path], builder: str, chunk: int = 1 << 24) -> None:
    """Text-based files must decode as UTF-8: name the first line that does not (such a row cannot
    even be read, so it cannot be skipped either). Reads each file once, in chunks."""
    if builder not in ("text", "json", "csv"):
        return
    for file in files:
        decoder, lines = codecs.getincrementaldecoder("utf-8")(), 0
        with open(file, "rb") as f:
            while True:
                block = f.read(chunk)
                try:
                    decoder.decode(block, final=not block)
                except UnicodeDecodeError as exc:
                    line = lines + exc.object.count(b"\n", 0, exc.start) + 1
                    raise ValueError(
                        f"dataset '{source}': line {line} of {file} is not valid UTF-8 (byte "
                        f"{exc.object[exc.start]:#04x}); such a row cannot be read, so it cannot be skipped: re-encode "
                        f"the file, e.g. iconv -f utf-8 -t utf-8 -c {file.name} > fixed{file.suffix} (drops the "
                        "invalid bytes)"
                    ) from None
                if not block:
                    break
                lines += block.count(b"\n")


def check_json_lines(source: str, files: list[Path]) -> None:
    """After the json builder failed on ``files``: name the first line of a JSON-lines file that is
    not one JSON object (a list, a number, a truncated object). Such a row cannot be read, so it
    cannot be skipped either. Files that are one JSON document (``[...]``) are left to the builder's
    own message."""
    for file in files:
        with open(file, encoding="utf-8") as f:
            first = f.read(1).lstrip()
            if first == "[":
                continue
            f.seek(0)
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    problem = f"is not valid JSON ({exc.msg} at character {exc.pos + 1})"
                else:
                    if isinstance(row, dict):
                        continue
                    problem = f"is a JSON {type(row).__name__} ({line.strip()[:40]}), not an object of columns"
                raise ValueError(
                    f"cannot read dataset '{source}' as json files (line {number} of {file} {problem}); such a row "
                    "cannot be read, so it cannot be skipped: fix or delete that line"
                )
