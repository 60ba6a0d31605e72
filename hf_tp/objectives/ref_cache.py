"""``--precompute-ref``'s log-probs kept with the dataset cache, so a second run on the same pairs
and reference (a ``--resume`` included) reads them instead of running the reference pass again.

The file's name is a hash of what the log-probs depend on (:func:`cache_key`): the reference
model (its folder, the size / modification time / content address of each weight file, and the
hash of its config.json), the tokenized pairs (a hash of every token and label of both sides,
which the tokenizer, the chat template and ``--seq-len`` decide), ``--seq-len`` and the compute
dtype. Any change gives another name, so the pass runs again; the mesh layout and the batch size
are not part of it (they move the log-probs by round-off only). The files live under the
``datasets`` cache (``HF_DATASETS_CACHE``), in ``hf_tp_reference_logps/``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
import torch.distributed as dist

from hf_tp.objectives.precompute import CHOSEN, REJECTED

VERSION = 1  # of the file and of the key's fields
PAIR_COLUMNS = ("input_ids", "labels", "rejected_input_ids", "rejected_labels")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def data_fingerprint(data: datasets.Dataset, rows_per_read: int = 10_000) -> str:
    """A hash of every row's tokens and labels, both sides, in order (lengths included), read a
    slice of rows at a time (a filtered dataset's rows, not its whole table)."""
    parts = {(name, what): hashlib.sha256() for name in PAIR_COLUMNS for what in ("lengths", "values")}
    for table in data.select_columns(list(PAIR_COLUMNS)).with_format("arrow").iter(batch_size=rows_per_read):
        for name in PAIR_COLUMNS:
            column = table.column(name).combine_chunks()
            parts[name, "lengths"].update(np.asarray(pc.list_value_length(column), dtype=np.int64).tobytes())
            parts[name, "values"].update(np.asarray(column.flatten(), dtype=np.int64).tobytes())
    return hashlib.sha256(f"{len(data)}:{[p.hexdigest() for p in parts.values()]}".encode()).hexdigest()


def weights_fingerprint(model_dir: Path) -> dict:
    """The reference checkpoint's identity without reading its weights: each weight file's name,
    size, modification time and the name of the file it links to (a Hub cache snapshot links to
    blobs named by their content hash), and the hash of its config.json."""
    files = sorted({f for pattern in WEIGHT_FILES for f in model_dir.glob(pattern)})
    config = model_dir / "config.json"
    return {
        "folder": str(model_dir.resolve()),
        "weights": [[f.name, f.stat().st_size, f.stat().st_mtime_ns, Path(os.path.realpath(f)).name] for f in files],
        "config": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
    }


def cache_key(model_dir: Path, data: datasets.Dataset, seq_len: int, dtype: str) -> str:
    """The name of the log-probs of ``data`` under the reference in ``model_dir`` (module doc)."""
    fields = dict(
        version=VERSION, model=weights_fingerprint(model_dir), data=data_fingerprint(data), seq_len=seq_len, dtype=dtype
    )
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def cache_path(key: str, root: Path | None = None) -> Path:
    """Where the log-probs of ``key`` are kept: ``HF_DATASETS_CACHE/hf_tp_reference_logps/``."""
    return Path(root or datasets.config.HF_DATASETS_CACHE) / "hf_tp_reference_logps" / f"{key}.npz"


def _load(path: Path, rows: int) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as f:
            chosen, rejected = f["chosen"], f["rejected"]
    except (OSError, ValueError, KeyError):  # absent, or cut short by a crash: computed again
        return None
    return (chosen, rejected) if len(chosen) == len(rejected) == rows else None


def _save(path: Path, chosen: list[float], rejected: list[float]) -> None:
    """Written to a temporary name and renamed: a reader never sees half a file (ranks that share
    the folder write the same bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{dist.get_rank()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, chosen=np.asarray(chosen, dtype=np.float64), rejected=np.asarray(rejected, dtype=np.float64))
    os.replace(tmp, path)


def cached_reference_logps(
    data: datasets.Dataset, compute: Callable[[], datasets.Dataset], path: Path, device: torch.device
) -> tuple[datasets.Dataset, bool]:
    """(``data`` with the :data:`CHOSEN` / :data:`REJECTED` columns, whether they were computed):
    read from ``path`` when every rank has it (one all-reduce: the pass has collectives, so the
    ranks decide together), else ``compute()`` (on every rank) and written there."""
    cached = _load(path, len(data))
    every = torch.tensor([0 if cached is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(every, op=dist.ReduceOp.MIN)
    if every.item():
        return data.add_column(CHOSEN, cached[0].tolist()).add_column(REJECTED, cached[1].tolist()), False
    scored = compute()
    if _load(path, len(data)) is None:
        _save(path, scored[CHOSEN], scored[REJECTED])
    return scored, True
