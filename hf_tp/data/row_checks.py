"""Checks of every row of a local dataset, made before any rank starts: each row against its
format (types, missing keys, empty or null fields: no tokenizer needed) and the bytes of text
files against UTF-8. Each raises a one-line ``ValueError`` that names the row by its place
(:mod:`hf_tp.data.places`: ``line N of FILE``, counted from 1) and says how to fix it.
"""

from __future__ import annotations

import codecs
import json
import re
import shlex
from pathlib import Path

import datasets

from hf_tp.data.files import files_with_rows
from hf_tp.data.formats import IMAGES, TEXT, DataFormat
from hf_tp.data.formats.rows import row_problem
from hf_tp.data.places import RowPlaces, split_total, summarize_places

# Bytes 0x80-0x9f that Windows-1252 leaves undefined: a file holding them is not Windows-1252.
_CP1252_UNDEFINED = frozenset(b"\x81\x8d\x8f\x90\x9d")
_C1 = re.compile("[\udc80-\udc9f]")  # bytes 0x80-0x9f that are no part of a UTF-8 character
_UTF8 = re.compile("[^\x00-\x7f\udc80-\udcff]")  # a character beyond ASCII, read as UTF-8
_CANNOT_SKIP = "a line that cannot be read cannot be skipped"


def check_all_rows(
    ds: datasets.Dataset, fmt: DataFormat, source: str, shown: int = 5, places: RowPlaces | None = None
) -> None:
    """One pass over every row of ``ds`` (the format's columns only, no tokenizer): raises a
    ``ValueError`` naming the first bad row, what is wrong with it, and which others are bad; or,
    for text, that no row holds any text (the ranks would find no token)."""
    places = places or RowPlaces(f"'{source}'", str(ds.split) if ds.split else None, split_total(ds))
    names = (fmt.column, "prompt", "completion", "chosen", "rejected", "tools", "images")
    columns = [c for c in names if c in ds.column_names]
    bad: list[tuple[int, str]] = []
    index, has_text = 0, fmt.kind != TEXT
    for batch in ds.select_columns(columns).iter(batch_size=1000):
        for row in (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)):
            problem = row_problem(fmt, row) if fmt.kind != IMAGES else image_problem(row, fmt.column, source)
            if problem is not None:
                bad.append((index, problem))
            elif not has_text:
                has_text = not row[fmt.column].isspace() and row[fmt.column] != ""
            index += 1
    if bad:
        problem, where = bad[0][1], places(bad[0][0])
        others = summarize_places([places(i) for i, _ in bad[1:shown]], known=where.split(" of ", 1)[1])
        rows = "row" if len(bad) == 2 else "rows"
        more = f"; {len(bad) - 1} more bad {rows} ({others}{', ...' if len(bad) > shown else ''})"
        raise ValueError(
            f"{where}: {problem}{more if others else ''}; fix it, or pass --skip-bad-rows to drop bad rows"
        )
    if not has_text:
        raise ValueError(
            f"dataset '{source}' has no text: every row of column '{fmt.column}' is empty or blank; add text, or pass "
            "--text-column to train on another column"
        )


def image_problem(row: dict, column: str, source: str) -> str | None:
    """An image + text row's problem, its image paths read from the dataset's folder (or the working directory)."""
    from hf_tp.data.formats.images import image_row_problem
    from hf_tp.data.image_data import dataset_dir

    return image_row_problem({"messages": row.get(column), "images": row.get("images")}, dataset_dir(source))


def check_utf8(source: str, files: list[Path], builder: str, chunk: int = 1 << 24) -> None:
    """Text-based files must decode as UTF-8: name the first line that does not and the command
    that converts the file (such a row cannot even be read, so it cannot be skipped either). Reads
    each file once, in chunks (and once more where one is not UTF-8, to tell Latin-1 from
    Windows-1252)."""
    if builder not in ("text", "json", "csv"):
        return
    directory = Path(source).expanduser().is_dir()
    for file in files:
        found = _first_non_utf8(file, chunk)
        if found is not None:
            raise ValueError(_not_utf8(source, file, *found, directory=directory))


def _first_non_utf8(file: Path, chunk: int) -> tuple[int, bytes, int] | None:
    """The first line of ``file`` that is not UTF-8 (1-based), its bytes, and its first bad byte."""
    decoder, lines = codecs.getincrementaldecoder("utf-8")(), 0
    with open(file, "rb") as f:
        while True:
            block = f.read(chunk)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                data, at = exc.object, exc.start
                start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
                return lines + data.count(b"\n", 0, at) + 1, data[start : end if end >= 0 else len(data)], data[at]
            if not block:
                return None
            lines += block.count(b"\n")


def _not_utf8(source: str, file: Path, line: int, text: bytes, byte: int, *, directory: bool) -> str:
    """The one line for a file that is not UTF-8: where, what it looks like, the command that converts it."""
    encoding, looks = _guess_encoding(file, text)
    name = shlex.quote(str(file))
    what = f"byte {byte:#04x}"
    if encoding in ("latin1", "cp1252"):
        what += f", {bytes([byte]).decode(encoding)!r} in {'Latin-1' if encoding == 'latin1' else 'Windows-1252'}"
    where = f"dataset '{source}': line {line} of {file} is not UTF-8 ({what})"
    if looks == "mixed":
        lists = f"LC_ALL=C.UTF-8 grep -naxv '.*' {name} lists them"
        return (
            f"{where}, while other lines are: the file mixes encodings, and converting all of it would garble "
            f"those; re-encode line {line} and the other lines that are not UTF-8 ({lists}) ({_CANNOT_SKIP})"
        )
    out = file.with_name(f"{file.stem}_utf8{file.suffix}")
    convert = f"iconv -f {encoding or 'ENCODING'} -t utf-8 {name} > {shlex.quote(str(out))}"
    use = f"then replace {file} with {out}" if directory else f"then use {out} instead"
    if not encoding:
        return f"{where}; find its encoding (file -i {name}) and convert it: {convert}, {use} ({_CANNOT_SKIP})"
    return f"{where}; it looks like {looks}: convert it with {convert}, {use} ({_CANNOT_SKIP})"


def _guess_encoding(file: Path, text: bytes) -> tuple[str, str]:
    """``iconv``'s name for the encoding ``file`` seems to be in and how to say it, from the first
    line that is not UTF-8 (``text``) and the whole file: ``("", "")`` when there is no good guess,
    ``("", "mixed")`` for a file with UTF-8 lines too.

    Latin-1 and Windows-1252 differ in bytes 0x80-0x9f only (control characters in Latin-1, curly
    quotes and dashes in Windows-1252): where such bytes are in the file, it is converted as
    Windows-1252, so that no quote becomes an invisible control character."""
    with open(file, "rb") as f:
        if f.read(2) in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
            return "utf-16", "UTF-16 (it starts with a UTF-16 byte-order mark)"
    try:  # the line as Windows-1252: text (tabs aside), or not text at all (binary data, another encoding)
        if not text.decode("cp1252").rstrip("\r\n").replace("\t", " ").isprintable():
            return "", ""
    except UnicodeDecodeError:
        return "", ""
    c1, utf8 = _scan_non_utf8(file)
    if utf8:
        return "", "mixed"
    return ("cp1252" if c1 and not c1 & _CP1252_UNDEFINED else "latin1"), "Latin-1 / Windows-1252"


def _scan_non_utf8(file: Path, chunk: int = 1 << 24) -> tuple[set[int], bool]:
    """The bytes 0x80-0x9f of ``file`` that are no part of a UTF-8 character, and whether it holds
    UTF-8 characters beyond ASCII too."""
    decoder, c1, utf8 = codecs.getincrementaldecoder("utf-8")("surrogateescape"), set(), False
    with open(file, "rb") as f:
        while block := f.read(chunk):
            text = decoder.decode(block)
            c1.update(ord(c) - 0xDC00 for c in _C1.findall(text))
            utf8 = utf8 or _UTF8.search(text) is not None
    return c1, utf8


def check_json_lines(source: str, files: list[Path], reason: str = "") -> None:
    """After the json builder failed on ``files`` (with ``reason``): name the first line of a
    JSON-lines file that is not one JSON object (a list, a number, a truncated object), or else a
    blank line (the reader fails on those in a file whose columns mix types). Such a row cannot be
    read, so it cannot be skipped either. Files that are one JSON document (``[...]``) are left to
    the builder's own message."""
    blank: tuple[int, Path] | None = None
    for file in files:
        with open(file, "rb") as f:
            if f.read(1024).removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"["):
                continue
            f.seek(0)
            for number, line in enumerate(f, start=1):
                line = line.removeprefix(codecs.BOM_UTF8) if number == 1 else line
                if not line.strip():
                    blank = blank or (number, file)
                    continue
                problem = _json_line_problem(line)
                if problem is not None:
                    raise ValueError(
                        f"cannot read dataset '{source}' as json files (line {number} of {file} {problem}); such a "
                        "row cannot be read, so it cannot be skipped: fix or delete that line"
                    )
    if blank is not None:
        (number, file), out = blank, blank[1].with_name(f"{blank[1].stem}_noblank{blank[1].suffix}")
        remove = f"grep -v '^[[:space:]]*$' {shlex.quote(str(file))} > {shlex.quote(str(out))}"
        raise ValueError(
            f"cannot read dataset '{source}' as json files ({reason or 'the json reader failed'}): line {number} of "
            f"{file} is blank, which the json reader cannot take in a file whose columns mix types; remove the "
            f"blank lines with {remove}, then use {out} instead"
        )


def _json_line_problem(line: bytes) -> str | None:
    """What makes one line of a JSON-lines file no row (not JSON, not an object), or None."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"is not valid JSON ({exc.msg.removesuffix(' at')} at character {exc.pos + 1})"
    except UnicodeDecodeError:
        return "is not UTF-8"
    if isinstance(row, dict):
        return None
    return f"is a JSON {type(row).__name__} ({line.decode('utf-8', 'replace').strip()[:40]}), not an object of columns"


def check_readable(source: str, reason: str = "") -> None:
    """Where a local dataset failed to read (``reason``): raise the line that cannot be read (bytes
    that are not UTF-8, a JSON line that is not an object), if it is one of those."""
    found = files_with_rows(source)
    if found is None:
        return
    builder, files = found
    check_utf8(source, files, builder)
    if builder == "json":
        check_json_lines(source, files, reason)
