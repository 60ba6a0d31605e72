"""The files of a local dataset: the ``datasets`` builder that reads them (from their extension),
and which of them hold no rows (builders fail on those, so they are left out everywhere: loading,
streaming and naming the line of a row must see the same files)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# File extension -> the `datasets` builder that reads it.
SUPPORTED_EXTENSIONS: dict[str, str] = {
    ".txt": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
SUPPORTED = ", ".join(SUPPORTED_EXTENSIONS)


def data_files(source: str, path: Path) -> tuple[str, list[Path]]:
    """The builder and the sorted files of a local file or directory (hidden ones left out)."""
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in SUPPORTED_EXTENSIONS:
            raise ValueError(
                f"unsupported file extension '{path.suffix}' of dataset '{source}'; supported: {SUPPORTED}"
            )
        return SUPPORTED_EXTENSIONS[suffix], [path]
    files = sorted(
        f
        for f in path.rglob("*")
        if f.is_file()
        and f.suffix.lower() in SUPPORTED_EXTENSIONS
        and not any(part.startswith(".") for part in f.relative_to(path).parts)
    )
    if not files:
        raise ValueError(f"no data files in directory '{source}'; supported extensions: {SUPPORTED}")
    builders = {SUPPORTED_EXTENSIONS[f.suffix.lower()] for f in files}
    if len(builders) > 1:
        found = ", ".join(sorted({f.suffix.lower() for f in files}))
        raise ValueError(f"directory '{source}' mixes file types ({found}); keep files of one type in it")
    return builders.pop(), files


def files_with_rows(source: str) -> tuple[str, list[Path]] | None:
    """The builder and the files that hold rows of ``source`` if it is a readable local file or
    directory, else None (a Hub id, a dataset in memory, an unsupported path)."""
    path = Path(source).expanduser()
    if not source or not path.exists():
        return None
    try:
        builder, files = data_files(source, path)
    except ValueError:
        return None
    return builder, [f for f in files if not has_no_rows(f, builder)]


def has_no_rows(file: Path, builder: str) -> bool:
    """``file`` holds no rows: it is empty, a JSON-lines or text file of blank lines only (a text
    file of blank lines has no document: it is as empty as a file of no bytes), or a parquet file
    of 0 rows."""
    if file.stat().st_size == 0:
        return True
    if builder in ("json", "text"):  # json: datasets before 4.8.5 fails on blank lines only
        return _blank(file)
    if builder == "parquet":
        try:
            return pq.read_metadata(file).num_rows == 0
        except (pa.ArrowException, OSError):
            return False  # not a readable parquet file: load_dataset reports it
    return False


def _blank(file: Path) -> bool:
    """Only whitespace bytes; stops at the first chunk with another byte (the first, usually)."""
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True
