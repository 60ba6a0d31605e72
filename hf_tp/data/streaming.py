"""Streaming data (``--streaming``): rows packed on the fly from a ``datasets.IterableDataset``,
with a position that a checkpoint stores and a resumed run restores exactly.

Every rank reads the same stream in the same order and packs it into the same rows, so row ``r``
of the stream is the same everywhere and step ``s``'s global batch is rows ``s * G`` to
``(s + 1) * G - 1`` whatever the mesh (the mesh-invariance of :class:`GlobalBatchOrder`, without
shuffling: the dataset's own order, epoch after epoch). No pass over the whole dataset happens:
documents are tokenized as they are read. The position is the stream's own ``state_dict`` (the
shard and example it is at) plus the document pieces read but not yet packed into a row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import datasets
import pyarrow as pa
import torch

from hf_tp.data.collator import PadToMultipleCollator
from hf_tp.data.formats import DataFormat, encode_batch
from hf_tp.data.formats.rows import SKIPPED
from hf_tp.data.row_checks import check_readable
from hf_tp.data.sampler import split_global_batch
from hf_tp.data.steps import StepBatches, count_batch_targets, to_device
from hf_tp.labels import IGNORE_INDEX


class PackedStream:
    """Rows of exactly ``seq_len`` tokens from a stream of raw rows, packed as
    :func:`hf_tp.data.packing.pack_documents` packs a whole dataset (the same rows, in order)."""

    def __init__(
        self,
        raw: datasets.IterableDataset,
        fmt: DataFormat,
        tokenizer: Any,
        seq_len: int,
        document_masking: bool,
        *,
        skip_bad_rows: bool = False,
        report: Callable[[str], None] | None = None,
    ):
        label = f"'{raw.info.dataset_name}'" if raw.info.dataset_name else "(stream)"
        columns = list(raw.features) if raw.features is not None else None
        # --skip-bad-rows: drop malformed rows, telling ``report`` about the first few
        self.skip_bad_rows, self.report, self.skipped = skip_bad_rows, report, 0
        self.docs = raw.map(
            lambda batch, idx: encode_batch(fmt, batch, idx, tokenizer, label, skip=self.skip_bad_rows),
            batched=True,
            with_indices=True,
            remove_columns=columns,
        )
        self.seq_len, self.document_masking, self.label = seq_len, document_masking, label
        self.pending: list[tuple[list[int], list[int]]] = []  # pieces read, not yet in a row
        self.epoch = 0
        self._iter: Iterator[dict] | None = None
        self._read_this_epoch = 0

    def _next_doc(self) -> tuple[list[int], list[int]]:
        while True:
            if self._iter is None:
                self.docs.set_epoch(self.epoch)
                self._iter, self._read_this_epoch = iter(self.docs), 0
            doc = self._read()
            if doc is not None and doc.get(SKIPPED):
                self._note_skipped(doc[SKIPPED])
                continue
            if doc is not None:
                self._read_this_epoch += 1
                ids = list(doc["input_ids"])
                labels = list(doc["labels"]) if doc.get("labels") is not None else list(ids)
                return ids, labels
            if self._read_this_epoch == 0:
                raise ValueError(f"dataset {self.label} yields no documents; check the data and --text-column")
            self.epoch, self._iter = self.epoch + 1, None

    def _read(self) -> dict | None:
        """The next document; rows the reader cannot decode stop the run with a line, not a traceback:
        for local files the line that cannot be read (bytes that are not UTF-8, a JSON line that is
        not an object), else how many rows were read before it."""
        try:
            return next(self._iter, None)
        except (UnicodeDecodeError, pa.ArrowException) as exc:
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
            if self.label.startswith("'"):
                check_readable(self.label[1:-1], reason)
            raise ValueError(
                f"dataset {self.label}: cannot read the rows after row {self._read_this_epoch + self.skipped} of "
                f"the stream ({reason})"
            ) from None

    def _note_skipped(self, line: str, shown: int = 5) -> None:
        self.skipped += 1
        if self.report is not None and self.epoch == 0 and self.skipped <= shown:
            more = " (further bad rows are dropped without a note)" if self.skipped == shown else ""
            self.report(f"hf-tp: --skip-bad-rows dropped {line}{more}")

    def next_row(self) -> dict[str, list[int]]:
        """The next packed row: ``input_ids``, ``labels`` (and ``position_ids`` with document masking)."""
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        while len(ids) < self.seq_len:
            piece_ids, piece_labels = self.pending.pop(0) if self.pending else self._next_doc()
            room = self.seq_len - len(ids)
            if len(piece_ids) > room:
                self.pending.insert(0, (piece_ids[room:], piece_labels[room:]))
                piece_ids, piece_labels = piece_ids[:room], piece_labels[:room]
            if self.document_masking and piece_ids:
                piece_labels = [IGNORE_INDEX, *piece_labels[1:]]
                positions += range(len(piece_ids))
            ids += piece_ids
            labels += piece_labels
        row = {"input_ids": ids, "labels": labels}
        if self.document_masking:
            row["position_ids"] = positions
        return row

    def state_dict(self) -> dict[str, Any]:
        """The position: JSON-able, the same on every rank."""
        stream = self.docs.state_dict() if self._iter is not None else None
        return {"epoch": self.epoch, "stream": stream, "pending": [list(p) for p in self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.pending = [(list(ids), list(labels)) for ids, labels in state["pending"]]
        self._iter = None
        if state["stream"] is not None:
            self.docs.set_epoch(self.epoch)
            self.docs.load_state_dict(state["stream"])
            self._iter, self._read_this_epoch = iter(self.docs), 1


@dataclass
class StreamingBatchSource:
    """:class:`hf_tp.data.steps.StepBatchSource` for a stream: steps are read in order, and the
    position before each step is kept for the checkpoint written after the step before it."""

    stream: PackedStream
    global_batch: int
    collate: PadToMultipleCollator
    dp_rank: int
    dp: int
    micro_batch: int
    grad_accum: int
    device: torch.device
    next_step: int = 0
    _states: dict[int, dict] = field(default_factory=dict)

    def __call__(self, step: int) -> StepBatches:
        if step != self.next_step:
            raise RuntimeError(f"a stream is read in order: step {self.next_step} is next, not {step}")
        self._states = {k: v for k, v in self._states.items() if k >= step - 1}
        self._states[step] = self.stream.state_dict()
        rows = [self.stream.next_row() for _ in range(self.global_batch)]
        self.next_step += 1
        mine = split_global_batch(
            rows, dp_rank=self.dp_rank, dp=self.dp, micro_batch=self.micro_batch, grad_accum=self.grad_accum
        )
        batches = [to_device(self.collate(r), self.device) for r in mine]
        return StepBatches(count_batch_targets(rows, step), sum(len(r["input_ids"]) for r in rows), batches)

    def state_for(self, step: int) -> dict[str, Any]:
        """The stream position before step ``step`` (0-based): what a run resumed there reads next."""
        if step == self.next_step:
            return self.stream.state_dict()
        return self._states[step]

    def resume_at(self, step: int, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        self.next_step = step
