"""Loading a text dataset (local files or a Hub id) and tokenizing it into training examples.

Every check raises a one-line ``ValueError`` that names the dataset and the fix, and the output
depends only on the data, the tokenizer and ``seq_len``, so every rank builds the same examples.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datasets.exceptions import DatasetGenerationError, DatasetsError
from datasets.table import InMemoryTable

# File extension -> the `datasets` builder that reads it.
SUPPORTED_EXTENSIONS: dict[str, str] = {
    ".txt": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_SUPPORTED = ", ".join(SUPPORTED_EXTENSIONS)
# "name" or "org/name": anything else (more slashes, spaces, a leading dot) cannot be on the Hub.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def load_text_dataset(source: str, *, text_column: str = "text", split: str = "train") -> datasets.Dataset:
    """Load ``source``: a local file, a local directory of files of one type, or a Hub dataset id.

    Local files are read with the builder of their extension (``.txt``: the "text" builder, one
    row per line, column "text") and form the "train" split; ``split`` names the Hub split (both
    take slices such as ``"train[:1000]"``). The dataset's name in later messages is ``source``.
    """
    path = Path(source).expanduser()
    ds = _load_local(source, path, split) if path.exists() else _load_hub(source, split)
    if len(ds) == 0:
        raise ValueError(f"dataset '{source}' is empty")
    _check_text_column(ds, text_column, f"'{source}'")
    ds.info.dataset_name = source
    return ds


def check_text_dataset(source: str, *, text_column: str = "text", split: str = "train") -> None:
    """Before any rank starts: what :func:`load_text_dataset` would reject, decided from as little
    as possible. Raises its one-line ``ValueError``s (not found, unreadable, empty, no such text
    column or not strings).

    ``.txt`` files need only their sizes (their one column is "text"; an empty file has no rows);
    other local files and Hub ids stream just their first row. What the first row cannot decide
    (a bad row further on, too few tokens for one block) is left to the ranks.
    """
    path = Path(source).expanduser()
    if not path.exists():
        _check_hub_first_row(source, text_column, split)
        return
    builder, files = _data_files(source, path)
    files = [f for f in files if not _has_no_rows(f, builder)]
    if not files:
        raise ValueError(f"dataset '{source}' is empty")
    if builder == "text":
        _check_columns(["text"], datasets.Value("string"), text_column, f"'{source}'")
        return
    try:
        with _quiet_datasets():  # its "Failed to load JSON" log line would repeat the error below
            stream = datasets.load_dataset(builder, data_files=[str(f) for f in files], split=split, streaming=True)
            first = next(iter(stream), None)
    except (DatasetsError, ValueError, OSError) as exc:
        raise ValueError(f"cannot read dataset '{source}' as {builder} files ({_reason(exc)})") from None
    _check_first_row(stream, first, source, text_column)


def _check_hub_first_row(source: str, text_column: str, split: str) -> None:
    from hf_tp.checkpoint.hub import hub_unreachable

    not_found = f"dataset not found: '{source}' is neither a local file/directory nor a dataset on the Hub"
    if not _HUB_ID.match(source) or Path(source).suffix.lower() in SUPPORTED_EXTENSIONS:
        raise ValueError(f"{not_found} (no such file or directory, and not a Hub id)")
    unreachable = hub_unreachable()
    if unreachable is not None:
        if datasets.config.HF_HUB_OFFLINE:  # from the cache: memory-mapped, so reading it costs little
            ds = _load_hub(source, split)
            _check_first_row(ds, ds[0] if len(ds) else None, source, text_column)
            return
        raise ValueError(
            f"the Hub cannot be reached ({unreachable}) to load dataset '{source}'; if it is in the "
            "cache, set HF_HUB_OFFLINE=1"
        )
    try:
        stream = datasets.load_dataset(source, split=split, streaming=True)
        first = next(iter(stream), None)
    except datasets.exceptions.DatasetNotFoundError as exc:
        raise ValueError(f"{not_found} ({_reason(exc)})") from None
    except Exception:  # noqa: BLE001 - a dataset that does not stream: the ranks load it in full
        return
    _check_first_row(stream, first, source, text_column)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def _check_first_row(
    stream: datasets.IterableDataset | datasets.Dataset, first: dict | None, source: str, text_column: str
) -> None:
    if first is None:
        raise ValueError(f"dataset '{source}' is empty")
    features = stream.features
    feature = features.get(text_column) if features is not None else None
    if feature is None and first.get(text_column) is not None and not isinstance(first[text_column], str):
        feature = type(first[text_column]).__name__  # the first row's value, when the stream has no schema
    _check_columns(list(features) if features is not None else list(first), feature, text_column, f"'{source}'")


def tokenize_dataset(
    ds: datasets.Dataset, tokenizer: Any, *, text_column: str = "text", seq_len: int, pack: bool = True
) -> datasets.Dataset:
    """Tokenize ``ds`` into a Dataset with the single column ``input_ids``.

    Documents are tokenized without added special tokens and each gets the tokenizer's eos (when
    it has one) appended; empty and whitespace-only documents are skipped. ``pack=True`` concatenates them all, in
    order, and cuts the stream into consecutive blocks of exactly ``seq_len`` tokens (the tail
    that does not fill a block is dropped). ``pack=False`` keeps one row per document, truncated to
    ``seq_len`` (a truncated document loses its eos).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got seq_len={seq_len}")
    label = _label(ds)
    _check_text_column(ds, text_column, label)
    eos = tokenizer.eos_token_id

    def encode(batch: dict[str, list]) -> dict[str, list[list[int]]]:
        texts = [text for text in batch[text_column] if text and not text.isspace()]
        if not texts:
            return {"input_ids": []}
        # verbose=False: documents longer than the model's context are expected before packing.
        ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        docs = [doc + [eos] if eos is not None else doc for doc in ids if doc]
        return {"input_ids": docs if pack else [doc[:seq_len] for doc in docs]}

    tokens = ds.map(encode, batched=True, remove_columns=ds.column_names, desc="Tokenizing")
    if not pack:
        if len(tokens) == 0:
            raise ValueError(f"dataset {label} has no tokens: every row of text column '{text_column}' is empty")
        return tokens
    # Packing runs once over the whole token stream (not per map batch), so blocks are exact.
    flat = _flat_ids(tokens)
    num_blocks = len(flat) // seq_len
    if num_blocks == 0:
        raise ValueError(
            f"dataset {label} has only {len(flat)} tokens, fewer than one block of seq_len={seq_len}; "
            "lower --seq-len or add data"
        )
    blocks = pa.FixedSizeListArray.from_arrays(pa.array(flat[: num_blocks * seq_len]), seq_len)
    packed = datasets.Dataset(InMemoryTable(pa.table({"input_ids": blocks})))
    packed.info.dataset_name = ds.info.dataset_name
    return packed


def _flat_ids(tokens: datasets.Dataset) -> np.ndarray:
    """All token ids of ``tokens`` (a fresh ``map`` output, so its table is in row order), as one array."""
    if len(tokens) == 0:  # a map that returns no rows keeps the input's schema: there is no input_ids column
        return np.zeros(0, dtype=np.int32)
    return pc.list_flatten(tokens.data.column("input_ids")).to_numpy()


def _label(ds: datasets.Dataset) -> str:
    """How messages name ``ds``: its source when it came from ``load_text_dataset``."""
    return f"'{ds.info.dataset_name}'" if ds.info.dataset_name else "(in memory)"


def _check_text_column(ds: datasets.Dataset, text_column: str, label: str) -> None:
    _check_columns(ds.column_names, ds.features.get(text_column), text_column, label)


def _check_columns(columns: list[str], feature: Any, text_column: str, label: str) -> None:
    """``text_column`` is one of ``columns`` and its ``feature`` (None: unknown) holds strings."""
    if text_column not in columns:
        raise ValueError(
            f"text column '{text_column}' not in dataset {label}; its columns are: {', '.join(columns)}; "
            "pass --text-column"
        )
    if feature is None:
        return
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ValueError(
            f"text column '{text_column}' of dataset {label} holds {feature}, not strings; pass --text-column"
        )


def _load_local(source: str, path: Path, split: str) -> datasets.Dataset:
    builder, files = _data_files(source, path)
    files = [f for f in files if not _has_no_rows(f, builder)]  # builders fail on empty files
    if not files:
        raise ValueError(f"dataset '{source}' is empty")
    names = [str(f) for f in files]
    try:
        return datasets.load_dataset(builder, data_files=names, split=split)
    except (DatasetsError, ValueError, OSError, StopIteration) as exc:
        reason, maybe_empty = _reason(exc), isinstance(exc, ValueError)
    if maybe_empty and _num_rows(builder, names) == 0:  # e.g. a csv with only a header: "no data" for the split
        raise ValueError(f"dataset '{source}' is empty")
    raise ValueError(f"cannot read dataset '{source}' as {builder} files ({reason})")


def _num_rows(builder: str, data_files: list[str]) -> int | None:
    """Rows the builder found in ``data_files`` (its prepared cache makes this cheap), None if unreadable."""
    try:
        prepared = datasets.load_dataset_builder(builder, data_files=data_files)
        prepared.download_and_prepare()
    except (DatasetsError, ValueError, OSError, StopIteration):
        return None
    return sum(split.num_examples for split in (prepared.info.splits or {}).values())


def _data_files(source: str, path: Path) -> tuple[str, list[Path]]:
    """The builder and the sorted files of a local file or directory."""
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in SUPPORTED_EXTENSIONS:
            raise ValueError(
                f"unsupported file extension '{path.suffix}' of dataset '{source}'; supported: {_SUPPORTED}"
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
        raise ValueError(f"no data files in directory '{source}'; supported extensions: {_SUPPORTED}")
    builders = {SUPPORTED_EXTENSIONS[f.suffix.lower()] for f in files}
    if len(builders) > 1:
        found = ", ".join(sorted({f.suffix.lower() for f in files}))
        raise ValueError(f"directory '{source}' mixes file types ({found}); keep files of one type in it")
    return builders.pop(), files


def _has_no_rows(file: Path, builder: str) -> bool:
    if file.stat().st_size == 0:
        return True
    if builder == "parquet":
        try:
            return pq.read_metadata(file).num_rows == 0
        except (pa.ArrowException, OSError):
            return False  # not a readable parquet file: load_dataset reports it
    return False


def _load_hub(source: str, split: str) -> datasets.Dataset:
    not_found = f"dataset not found: '{source}' is neither a local file/directory nor a dataset on the Hub"
    if not _HUB_ID.match(source) or Path(source).suffix.lower() in SUPPORTED_EXTENSIONS:
        raise ValueError(f"{not_found} (no such file or directory, and not a Hub id)")
    try:
        return datasets.load_dataset(source, split=split)
    except OSError as exc:  # DatasetNotFoundError, ConnectionError when offline, Hub HTTP errors
        raise ValueError(f"{not_found} ({_reason(exc)})") from None
    except ValueError as exc:  # e.g. an unknown split or a missing config name
        raise ValueError(f"cannot load split '{split}' of dataset '{source}' ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    """The first line of the most specific message: builders wrap the real error in a generic one."""
    if isinstance(exc, DatasetGenerationError) and exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
