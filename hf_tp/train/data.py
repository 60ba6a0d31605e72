"""A run's data: the training rows (a tokenized dataset, or a packed stream with ``--streaming``),
the evaluation rows, and the per-step batch source the loop reads (it never sees the format)."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import torch.distributed as dist

from hf_tp.data import GlobalBatchOrder, PadToMultipleCollator, detect_format, load_text_dataset, tokenize_dataset
from hf_tp.data.columns import rename_dataset, rename_row
from hf_tp.data.datasets import load_stream
from hf_tp.data.formats.images import ImageBatchCollator, is_image_data
from hf_tp.data.formats.preference import check_objective_data
from hf_tp.data.formats.rows import ROW_COLUMN, skipped_summary
from hf_tp.data.image_data import check_image_rows, dataset_dir, encode_image_dataset
from hf_tp.data.image_steps import ImageStepBatchSource
from hf_tp.data.pairs import PairCollator, is_pair_example
from hf_tp.data.steps import StepBatchSource
from hf_tp.data.streaming import PackedStream, StreamingBatchSource
from hf_tp.run.config import TrainConfig
from hf_tp.run.distributed import rank0_first
from hf_tp.run.first_rows import NO_IMAGE_EVAL, image_rows_refusal
from hf_tp.run.fits import training_rows
from hf_tp.train.evaluation import EvalSet
from hf_tp.train.pair_evaluation import PairEvalSet


def build_batches(
    cfg: TrainConfig, tokenizer: Any, dp_rank: int, device: torch.device
) -> tuple[StepBatchSource | StreamingBatchSource, EvalSet | PairEvalSet | None]:
    """What the loop reads: this dp rank's batches of every step, and the evaluation set (or None).
    Rows are padded to a multiple of tp (the sequence is split over the tp ranks; 2 x cp x tp
    with context parallelism)."""
    images = image_batches(cfg, dp_rank, device)
    if images is not None:
        return images, None
    data, eval_data = build_data(cfg, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    train_collate = PadToMultipleCollator(pad_token_id=pad_id, multiple_of=cfg.row_multiple, row_lengths=True)
    if isinstance(data, datasets.Dataset) and is_pair_example(data.features):  # a pair's two rows, one micro-batch
        train_collate = PairCollator(train_collate)
    batches = batch_source(cfg, data, train_collate, dp_rank, device)
    if eval_data is None:
        return batches, None
    collate = PadToMultipleCollator(pad_token_id=pad_id, multiple_of=cfg.row_multiple)
    sizes = (cfg.batch_size, cfg.global_batch, cfg.eval_batches)
    if isinstance(train_collate, PairCollator):  # its loss and TRL's metrics over the held-out pairs
        return batches, PairEvalSet(eval_data, PairCollator(collate), dp_rank, cfg.dp, *sizes, device)
    return batches, EvalSet(eval_data, collate, dp_rank, cfg.dp, *sizes, device)


def image_batches(cfg: TrainConfig, dp_rank: int, device: torch.device) -> StepBatchSource | None:
    """Image + text conversations (:mod:`hf_tp.data.formats.images`): each row encoded once with
    the checkpoint's processor, batches processed per step; None for any other dataset. Not
    packed (a row is one conversation, padded to a multiple of tp), no evaluation set yet."""
    if cfg.streaming or not cfg.dataset or not Path(cfg.dataset).expanduser().exists():
        return None
    raw = rank0_first(lambda: load_text_dataset(cfg.dataset, split=cfg.split, config_name=cfg.dataset_config))
    if not is_image_data(raw.column_names):
        return None
    if cfg.eval_split or cfg.eval_dataset:
        raise ValueError(NO_IMAGE_EVAL)
    from transformers import AutoProcessor

    processor = rank0_first(lambda: AutoProcessor.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code))
    base, label = dataset_dir(cfg.dataset), f"'{cfg.dataset}'"
    if not cfg.skip_bad_rows:
        check_image_rows(raw, label, base)
    encode = dict(seq_len=cfg.seq_len, assistant_only=cfg.assistant_only_loss, label=label, base_dir=base)
    train, dropped = rank0_first(lambda: encode_image_dataset(raw, processor, skip=cfg.skip_bad_rows, **encode))
    if dropped:
        report_on_rank0(skipped_summary(dropped, label))
    if len(train) == 0:
        raise ValueError(f"dataset {label}: every row is bad (--skip-bad-rows dropped all {len(dropped)})")
    if cfg.packs and dist.get_rank() == 0:
        print("hf-tp: image + text rows are not packed: each row is one conversation, padded", file=sys.stderr)
    collate = ImageBatchCollator(processor, multiple_of=cfg.row_multiple, base_dir=base)
    return batch_source(cfg, train, collate, dp_rank, device)


def saved_with_checkpoints(batches: object, tokenizer: Any) -> Any:
    """What a checkpoint keeps for export beside the config: the processor that rendered image +
    text rows (its image processor and chat template, with the tokenizer), else the tokenizer."""
    collate = getattr(batches, "collate", None)
    return collate.processor if isinstance(collate, ImageBatchCollator) else tokenizer


def build_data(cfg: TrainConfig, tokenizer: Any) -> tuple[datasets.Dataset | PackedStream, datasets.Dataset | None]:
    """The training rows and the evaluation set (None without one), built on rank 0 first (the
    cache is shared). ``--eval-split`` holds out a seeded fraction of the training documents before
    tokenization, so no document is in both."""
    columns = dict(text_column=cfg.text_column, messages_column=cfg.messages_column)
    loading = dict(columns, renames=cfg.column_renames)

    def tokenize(ds: datasets.Dataset, keep_tail: bool) -> datasets.Dataset:
        fmt = detect_format(ds.column_names, assistant_only=cfg.assistant_only_loss, **columns)
        check_objective_data(cfg.objective, fmt, ds.info.dataset_name or "(in memory)")
        return tokenize_dataset(
            ds,
            tokenizer,
            seq_len=cfg.seq_len,
            pack=cfg.packs,
            fmt=fmt,
            document_masking=cfg.document_masking,
            keep_tail=keep_tail,
            skip_bad_rows=cfg.skip_bad_rows,
            report=report_on_rank0,
        )

    raw_eval = None
    if cfg.eval_dataset:
        raw_eval = rank0_first(
            lambda: load_text_dataset(
                cfg.eval_dataset, split=cfg.eval_dataset_split, config_name=cfg.dataset_config, **loading
            )
        )
    if cfg.streaming:
        stream = load_stream(cfg.dataset, split=cfg.split, config_name=cfg.dataset_config)
        first = next(iter(stream), None)
        if first is None:
            raise ValueError(f"dataset '{cfg.dataset}' is empty")
        names = list(stream.features) if stream.features is not None else list(first)
        stream = rename_dataset(stream, cfg.column_renames, f"'{cfg.dataset}'", names)
        names = list(rename_row(dict.fromkeys(names), cfg.column_renames, f"'{cfg.dataset}'"))
        fmt = detect_format(names, assistant_only=cfg.assistant_only_loss, label=f"'{cfg.dataset}'", **columns)
        if is_image_data(names):  # (hf-tp train refuses it before launch; ranks started by torchrun here)
            raise ValueError(image_rows_refusal(cfg.dataset, "--streaming"))
        skip = dict(skip_bad_rows=cfg.skip_bad_rows, report=report_on_rank0)
        train = PackedStream(stream, fmt, tokenizer, cfg.seq_len, cfg.document_masking, **skip)
    else:
        raw = rank0_first(
            lambda: load_text_dataset(cfg.dataset, split=cfg.split, config_name=cfg.dataset_config, **loading)
        )
        if cfg.eval_split:  # messages about a row name its number in the file, not in the split
            training_rows(len(raw), cfg.eval_split, f"'{cfg.dataset}'")  # (a Hub dataset's first check)
            raw = raw.add_column(ROW_COLUMN, np.arange(len(raw)))
            parts = raw.train_test_split(test_size=cfg.eval_split, seed=cfg.seed, shuffle=True)
            raw, raw_eval = parts["train"], parts["test"]
            raw.info.dataset_name = raw_eval.info.dataset_name = cfg.dataset
        train = rank0_first(lambda: tokenize(raw, keep_tail=False))
    return train, None if raw_eval is None else rank0_first(lambda: tokenize(raw_eval, keep_tail=True))


def report_on_rank0(line: str) -> None:
    """Print a data note (the rows ``--skip-bad-rows`` dropped) once, from rank 0."""
    if dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def batch_source(
    cfg: TrainConfig,
    train: datasets.Dataset | PackedStream,
    collate: PadToMultipleCollator | PairCollator | ImageBatchCollator,
    dp_rank: int,
    device,
) -> StepBatchSource | StreamingBatchSource:
    """What the loop calls for each step's batches: from a shuffled dataset or from the stream."""
    sizes = dict(micro_batch=cfg.batch_size, grad_accum=cfg.grad_accum, device=torch.device(device))
    if isinstance(train, PackedStream):
        return StreamingBatchSource(train, cfg.global_batch, collate, dp_rank, cfg.dp, **sizes)
    order = GlobalBatchOrder(num_examples=len(train), global_batch=cfg.global_batch, seed=cfg.seed)
    source = ImageStepBatchSource if isinstance(collate, ImageBatchCollator) else StepBatchSource  # dp ranks in step
    return source(train, order, collate, dp_rank, cfg.dp, **sizes)


def with_document_masking_checked(cfg: TrainConfig, model: torch.nn.Module) -> TrainConfig:
    """``cfg``, with document masking turned off (and said so) for a model whose attention mask
    does not come from transformers' ``masking_utils`` (the code that turns restarting
    ``position_ids`` into per-document masks): there packed documents would see each other."""
    if not (cfg.packs and cfg.document_masking):
        return cfg
    # The MRO: FSDP2 subclasses the model's class (FSDPLlamaModel) in a module of its own.
    modules = [inspect.getmodule(cls) for cls in type(model.get_decoder()).__mro__]
    names = ("create_causal_mask", "create_sliding_window_causal_mask")
    if any(hasattr(module, name) for module in modules for name in names):
        return cfg
    if dist.get_rank() == 0:
        print(
            f"hf-tp: {model.config.model_type} does not build its attention mask with transformers' masking_utils; "
            "packed documents are not masked from each other (--no-document-masking)",
            file=sys.stderr,
        )
    return dataclasses.replace(cfg, document_masking=False)
