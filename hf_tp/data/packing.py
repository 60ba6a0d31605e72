"""Packing documents into fixed-length rows, with the document boundaries kept.

Packed rows carry ``position_ids`` that restart at 0 where each document (or each piece of a
document cut by a row boundary) starts; transformers turns such ``position_ids`` into a
block-diagonal causal mask (sdpa, eager, flex) or varlen flash attention, so a document never
attends to another. The label of each document's first token is ignored: predicting it from the
previous document's end would be a target that the same document trained on its own lacks.
"""

from __future__ import annotations

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import InMemoryTable

from hf_tp.labels import IGNORE_INDEX


def flat_column(docs: datasets.Dataset, name: str) -> np.ndarray:
    """All values of list column ``name`` of a fresh ``map`` output (its table is in row order)."""
    if len(docs) == 0 or name not in docs.column_names:
        return np.zeros(0, dtype=np.int64)
    return pc.list_flatten(docs.data.column(name)).to_numpy().astype(np.int64)


def pack_documents(
    docs: datasets.Dataset, seq_len: int, *, document_masking: bool, label: str, keep_tail: bool = False
) -> datasets.Dataset:
    """Concatenate the documents of ``docs`` (``input_ids``, optional ``labels``) in order and cut
    the stream into consecutive rows of exactly ``seq_len`` tokens (the tail that does not fill a
    row is dropped, or with ``keep_tail`` kept as a shorter last row). With ``document_masking`` the rows get ``position_ids`` restarting per
    document and the first token of every document piece is no target."""
    ids = flat_column(docs, "input_ids")
    labels = flat_column(docs, "labels") if "labels" in docs.column_names else ids.copy()
    rows = len(ids) // seq_len
    n = len(ids) if keep_tail else rows * seq_len
    if len(ids) == 0:
        raise ValueError(f"dataset {label} has no tokens: every document in it is empty or blank; add data")
    if n == 0 or (rows == 0 and not keep_tail):
        raise ValueError(
            f"dataset {label} has only {len(ids)} tokens, fewer than one block of seq_len={seq_len}; "
            "lower --seq-len or add data"
        )
    columns = {"input_ids": ids[:n], "labels": labels[:n]}
    if document_masking:
        lengths = pc.list_value_length(docs.data.column("input_ids")).to_numpy()
        starts = np.zeros(len(ids) + 1, dtype=bool)
        starts[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = True
        starts = starts[:n]
        starts[::seq_len] = True  # a row boundary starts a new piece
        index = np.arange(n)
        columns["position_ids"] = index - np.maximum.accumulate(np.where(starts, index, 0))
        columns["labels"] = np.where(starts, IGNORE_INDEX, columns["labels"])
    if n % seq_len == 0:
        table = pa.table(
            {k: pa.FixedSizeListArray.from_arrays(pa.array(v.astype(np.int32)), seq_len) for k, v in columns.items()}
        )
    else:
        offsets = pa.array(list(range(0, n, seq_len)) + [n], type=pa.int32())
        table = pa.table(
            {k: pa.ListArray.from_arrays(offsets, pa.array(v.astype(np.int32))) for k, v in columns.items()}
        )
    packed = datasets.Dataset(InMemoryTable(table))
    packed.info.dataset_name = docs.info.dataset_name
    return packed
