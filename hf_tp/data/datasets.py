"""Loading a dataset (local files or a Hub id) and checking that its columns fit a data format.

Every check raises a one-line ``ValueError`` that names the dataset and the fix, and the output
depends only on the data, the tokenizer and ``seq_len``, so every rank builds the same examples.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import datasets
from datasets.exceptions import DatasetGenerationError, DatasetsError

from hf_tp.data.columns import rename_dataset, rename_row
from hf_tp.data.files import SUPPORTED_EXTENSIONS, data_files, has_no_rows
from hf_tp.data.formats import TEXT, DataFormat, detect_format
from hf_tp.data.formats.rows import row_problem
from hf_tp.data.places import RowPlaces, split_total
from hf_tp.data.row_checks import check_all_rows, check_json_lines, check_readable, check_utf8
from hf_tp.data.tokenize import check_string_column

# "name" or "org/name": anything else (more slashes, spaces, a leading dot) cannot be on the Hub.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def load_text_dataset(
    source: str,
    *,
    text_column: str | None = None,
    messages_column: str | None = None,
    split: str = "train",
    config_name: str | None = None,
    renames: dict[str, str] | None = None,
) -> datasets.Dataset:
    """Load ``source``: a local file, a local directory of files of one type, or a Hub dataset id
    (with its configuration ``config_name``, ``--dataset-config``).

    Local files are read with the builder of their extension (``.txt``: the "text" builder, one
    row per line, column "text") and form the "train" split; ``split`` names the Hub split (both
    take slices such as ``"train[:5%]"``, passed to ``datasets`` as is). The columns must fit a
    data format (:func:`hf_tp.data.formats.detect_format`). The dataset's name in later messages
    is ``source``. ``renames``: columns under other names (:mod:`hf_tp.data.columns`).
    """
    path = Path(source).expanduser()
    if path.exists():
        _no_config_for_local(source, config_name, split)
        ds = _load_local(source, path, split)
    else:
        ds = _load_hub(source, split, config_name)
    if len(ds) == 0:
        raise ValueError(f"dataset '{source}' is empty")
    ds = rename_dataset(ds, renames or {}, f"'{source}'")
    # Its rows are checked one by one where they are tokenized (a bad one named, or skipped).
    check_format(
        ds.column_names, ds.features, _first_row(ds, source), source, text_column, messages_column, check_row=False
    )
    ds.info.dataset_name = source
    return ds


def load_stream(source: str, *, split: str = "train", config_name: str | None = None) -> datasets.IterableDataset:
    """``source`` as a ``datasets.IterableDataset`` (``--streaming``): nothing is downloaded or
    prepared up front; local files are read as they are iterated."""
    path = Path(source).expanduser()
    try:
        if path.exists():
            _no_config_for_local(source, config_name, split)
            builder, files = data_files(source, path)
            names = [str(f) for f in files if not has_no_rows(f, builder)]
            if not names:
                raise ValueError(f"dataset '{source}' is empty")
            stream = datasets.load_dataset(builder, data_files=names, split=split, streaming=True)
        else:
            stream = datasets.load_dataset(source, name=config_name, split=split, streaming=True)
    except (DatasetsError, OSError) as exc:
        raise ValueError(f"cannot stream dataset '{source}' ({_reason(exc)})") from None
    stream.info.dataset_name = source
    return stream


def check_text_dataset(
    source: str,
    *,
    text_column: str | None = None,
    messages_column: str | None = None,
    split: str = "train",
    config_name: str | None = None,
    every_row: bool = False,
    skip_bad_rows: bool = False,
    renames: dict[str, str] | None = None,
) -> tuple[DataFormat, dict] | None:
    """Before any rank starts: what :func:`load_text_dataset` would reject, decided from as little
    as possible; returns the data format and the first row (None where a Hub dataset does not
    stream: the ranks check it). Raises its one-line ``ValueError``s (not found,
    unreadable, empty, no column of a known format, a first row not in that format, bytes that are
    not UTF-8).

    Hub ids stream just their first row. A local file or directory is loaded in full with
    ``every_row`` (the ranks reuse its cache) and each row is checked (:func:`check_all_rows`,
    unless ``skip_bad_rows``: the ranks drop them); without it (``--streaming``) its first row is
    read and its bytes checked. What the rows alone cannot decide (a conversation the chat template
    rejects, too few tokens for one block) is left to the ranks. ``renames``: columns under
    other names (:mod:`hf_tp.data.columns`).
    """
    path = Path(source).expanduser()
    renames = renames or {}
    if not path.exists():
        return _check_hub_first_row(source, text_column, messages_column, split, config_name, renames)
    _no_config_for_local(source, config_name, split)
    columns = dict(text_column=text_column, messages_column=messages_column, check_row=not skip_bad_rows)
    builder, files = data_files(source, path)
    check_utf8(source, files, builder)
    if every_row:
        with quiet_datasets():
            ds = _load_local(source, path, split)
        if len(ds) == 0:
            raise ValueError(f"dataset '{source}' is empty")
        ds = rename_dataset(ds, renames, f"'{source}'")
        places = RowPlaces(f"'{source}'", str(ds.split) if ds.split else split, split_total(ds))
        fmt = check_format(ds.column_names, ds.features, ds[0], source, **columns, places=places)
        if not skip_bad_rows:
            check_all_rows(ds, fmt, source, places=places)
        return fmt, ds[0]
    files = [f for f in files if not has_no_rows(f, builder)]
    if not files:
        raise ValueError(f"dataset '{source}' is empty")
    try:
        with quiet_datasets():  # its "Failed to load JSON" log line would repeat the error below
            stream = datasets.load_dataset(builder, data_files=[str(f) for f in files], split=split, streaming=True)
            first = next(iter(stream), None)
    # (TypeError: a JSON line that is a list, from datasets < 5.1)
    except (DatasetsError, ValueError, OSError, TypeError) as exc:
        if builder == "json":
            check_json_lines(source, files, _reason(exc))
        raise ValueError(f"cannot read dataset '{source}' as {builder} files ({_reason(exc)})") from None
    if first is None:
        raise ValueError(f"dataset '{source}' is empty")
    return _check_first_row(stream, first, source, text_column, messages_column, renames, check_row=not skip_bad_rows)


def _no_config_for_local(source: str, config_name: str | None, split: str = "train") -> None:
    """Local files: no Hub configuration, and one split, "train" (slices of it are fine)."""
    names = {part.split("[")[0].strip() for part in split.split("+")}
    if names != {"train"}:
        raise ValueError(
            f"local data files form one split, 'train'; got --split {split} (use train or a slice such as train[:5%])"
        )
    if config_name:
        raise ValueError(
            f"--dataset-config {config_name} names a configuration of a Hub dataset, but '{source}' is a local "
            "path; drop --dataset-config"
        )


def check_format(
    columns: list[str],
    features: datasets.Features | None,
    first: dict,
    source: str,
    text_column: str | None,
    messages_column: str | None,
    *,
    check_row: bool = True,
    places: RowPlaces | None = None,
) -> DataFormat:
    """The data format of a dataset with ``columns``, checked against its schema and (unless not
    ``check_row``: bad rows are skipped) its first row, which a message names by ``places``
    (default: the first row of the whole of ``source``)."""
    fmt = detect_format(columns, text_column=text_column, messages_column=messages_column, label=f"'{source}'")
    if fmt.kind == TEXT:
        feature = features.get(fmt.column) if features is not None else None
        check_string_column(feature, fmt.column, f"'{source}'")
    problem = row_problem(fmt, first) if check_row else None
    if problem is not None:
        where = (places or RowPlaces(f"'{source}'"))(0)
        raise ValueError(f"{where}: {problem}")
    return fmt


def _check_hub_first_row(
    source: str,
    text_column: str | None,
    messages_column: str | None,
    split: str,
    config_name: str | None,
    renames: dict[str, str],
) -> tuple[DataFormat, dict] | None:
    from hf_tp.core.model_source import hub_unreachable

    not_found = f"dataset not found: '{source}' is neither a local file/directory nor a dataset on the Hub"
    if not _HUB_ID.match(source) or Path(source).suffix.lower() in SUPPORTED_EXTENSIONS:
        raise ValueError(f"{not_found} (no such file or directory, and not a Hub id)")
    unreachable = hub_unreachable()
    if unreachable is not None:
        if datasets.config.HF_HUB_OFFLINE:  # from the cache: memory-mapped, so reading it costs little
            ds = _load_hub(source, split, config_name)
            return _check_first_row(ds, ds[0] if len(ds) else None, source, text_column, messages_column, renames)
        raise ValueError(
            f"the Hub cannot be reached ({unreachable}) to load dataset '{source}'; if it is in the "
            "cache, set HF_HUB_OFFLINE=1"
        )
    try:
        stream = datasets.load_dataset(source, name=config_name, split=split, streaming=True)
        first = next(iter(stream), None)
    except datasets.exceptions.DatasetNotFoundError as exc:
        raise ValueError(f"{not_found} ({_reason(exc)})") from None
    except Exception:  # noqa: BLE001 - a dataset that does not stream: the ranks load it in full
        return None
    return _check_first_row(stream, first, source, text_column, messages_column, renames)


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    level, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()  # the launcher's pass over the rows: one line at most
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _check_first_row(
    stream: datasets.IterableDataset | datasets.Dataset,
    first: dict | None,
    source: str,
    text_column: str | None,
    messages_column: str | None,
    renames: dict[str, str],
    check_row: bool = True,
) -> tuple[DataFormat, dict]:
    if first is None:
        raise ValueError(f"dataset '{source}' is empty")
    features = stream.features
    columns = list(features) if features is not None else list(first)
    if renames:  # (the features of renamed columns are not read: only a text column's is)
        columns, first = (
            list(rename_row(dict.fromkeys(columns), renames, f"'{source}'")),
            rename_row(first, renames, ""),
        )
    fmt = check_format(columns, features, first, source, text_column, messages_column, check_row=check_row)
    return fmt, first


def _first_row(ds: datasets.Dataset, source: str) -> dict:
    """``ds[0]``: the json reader does not check that text is UTF-8, so a file that is not fails
    here (or where its rows are tokenized): name the line."""
    try:
        return ds[0]
    except UnicodeDecodeError as exc:
        check_readable(source, _reason(exc))
        raise ValueError(f"dataset '{source}' holds text that is not UTF-8 ({_reason(exc)})") from None


def _load_local(source: str, path: Path, split: str) -> datasets.Dataset:
    builder, files = data_files(source, path)
    files = [f for f in files if not has_no_rows(f, builder)]  # builders fail on empty files
    if not files:
        raise ValueError(f"dataset '{source}' is empty")
    names = [str(f) for f in files]
    try:
        return datasets.load_dataset(builder, data_files=names, split=split)
    except (DatasetsError, ValueError, OSError, StopIteration, TypeError) as exc:  # (TypeError: see check_text_dataset)
        reason, maybe_empty = _reason(exc), isinstance(exc, ValueError)
    check_utf8(source, files, builder)  # (a json file that is not UTF-8 fails with another reason)
    if builder == "json":
        check_json_lines(source, files, reason)
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


def _load_hub(source: str, split: str, config_name: str | None = None) -> datasets.Dataset:
    not_found = f"dataset not found: '{source}' is neither a local file/directory nor a dataset on the Hub"
    if not _HUB_ID.match(source) or Path(source).suffix.lower() in SUPPORTED_EXTENSIONS:
        raise ValueError(f"{not_found} (no such file or directory, and not a Hub id)")
    try:
        return datasets.load_dataset(source, name=config_name, split=split)
    except OSError as exc:  # DatasetNotFoundError, ConnectionError when offline, Hub HTTP errors
        if datasets.config.HF_HUB_OFFLINE:  # it may well be on the Hub: the cache was all there was to read
            raise ValueError(
                f"dataset not found: '{source}' is not a local file/directory and not in the datasets cache, and "
                "HF_HUB_OFFLINE is set; unset it to download the dataset, or pass a local file"
            ) from None
        raise ValueError(f"{not_found} ({_reason(exc)})") from None
    except ValueError as exc:  # e.g. an unknown split or a missing config name
        raise ValueError(f"cannot load split '{split}' of dataset '{source}' ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    """The first line of the most specific message: builders wrap the real error in a generic one."""
    if isinstance(exc, DatasetGenerationError) and exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
