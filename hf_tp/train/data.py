"""A run's data: the training rows (a tokenized dataset, or a packed stream with ``--streaming``),
the evaluation rows, and the per-step batch source the loop reads (it never sees the format)."""

from __future__ import annotations

from typing import Any

import datasets
import torch

from hf_tp.data import GlobalBatchOrder, PadToMultipleCollator, detect_format, load_text_dataset, tokenize_dataset
from hf_tp.data.datasets import load_stream
from hf_tp.data.steps import StepBatchSource
from hf_tp.data.streaming import PackedStream, StreamingBatchSource
from hf_tp.train.config import TrainConfig
from hf_tp.train.setup import rank0_first


def build_data(cfg: TrainConfig, tokenizer: Any) -> tuple[datasets.Dataset | PackedStream, datasets.Dataset | None]:
    """The training rows and the evaluation set (None without one), built on rank 0 first (the
    cache is shared). ``--eval-split`` holds out a seeded fraction of the training documents before
    tokenization, so no document is in both."""
    columns = dict(text_column=cfg.text_column, messages_column=cfg.messages_column)

    def tokenize(ds: datasets.Dataset, keep_tail: bool) -> datasets.Dataset:
        fmt = detect_format(ds.column_names, assistant_only=cfg.assistant_only_loss, **columns)
        return tokenize_dataset(
            ds,
            tokenizer,
            seq_len=cfg.seq_len,
            pack=cfg.pack,
            fmt=fmt,
            document_masking=cfg.document_masking,
            keep_tail=keep_tail,
        )

    raw_eval = None
    if cfg.eval_dataset:
        raw_eval = rank0_first(
            lambda: load_text_dataset(
                cfg.eval_dataset, split=cfg.eval_dataset_split, config_name=cfg.dataset_config, **columns
            )
        )
    if cfg.streaming:
        stream = load_stream(cfg.dataset, split=cfg.split, config_name=cfg.dataset_config)
        first = next(iter(stream), None)
        if first is None:
            raise ValueError(f"dataset '{cfg.dataset}' is empty")
        names = list(stream.features) if stream.features is not None else list(first)
        fmt = detect_format(names, assistant_only=cfg.assistant_only_loss, label=f"'{cfg.dataset}'", **columns)
        train = PackedStream(stream, fmt, tokenizer, cfg.seq_len, cfg.document_masking)
    else:
        raw = rank0_first(
            lambda: load_text_dataset(cfg.dataset, split=cfg.split, config_name=cfg.dataset_config, **columns)
        )
        if cfg.eval_split:
            parts = raw.train_test_split(test_size=cfg.eval_split, seed=cfg.seed, shuffle=True)
            raw, raw_eval = parts["train"], parts["test"]
            raw.info.dataset_name = raw_eval.info.dataset_name = cfg.dataset
        train = rank0_first(lambda: tokenize(raw, keep_tail=False))
    return train, None if raw_eval is None else rank0_first(lambda: tokenize(raw_eval, keep_tail=True))


def batch_source(
    cfg: TrainConfig, train: datasets.Dataset | PackedStream, collate: PadToMultipleCollator, dp_rank: int, device
) -> StepBatchSource | StreamingBatchSource:
    """What the loop calls for each step's batches: from a shuffled dataset or from the stream."""
    sizes = dict(micro_batch=cfg.batch_size, grad_accum=cfg.grad_accum, device=torch.device(device))
    if isinstance(train, PackedStream):
        return StreamingBatchSource(train, cfg.global_batch, collate, dp_rank, cfg.dp, **sizes)
    order = GlobalBatchOrder(num_examples=len(train), global_batch=cfg.global_batch, seed=cfg.seed)
    return StepBatchSource(train, order, collate, dp_rank, cfg.dp, **sizes)
