"""Before launch, the first row of each dataset against the objective and the tokenizer (what the
rows alone cannot decide: the chat template, the tokenizer's offsets)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hf_tp.data.formats.preference import check_objective_data
from hf_tp.run.config import TrainConfig


def check_first_rows(cfg: TrainConfig, first_rows: dict) -> None:
    """The data of each dataset (``{source: (format, first row) or None}``) fits ``--objective``;
    chat, prompt/completion and preference data: the tokenizer can render and label the first
    row: a chat template where needed (one that reads ``tools`` for a tools column), a fast
    tokenizer (character offsets), role/content messages, an assistant turn."""
    for source, first in first_rows.items():
        check_objective_data(cfg.objective, first[0] if first is not None else None, source)
    first_rows = {k: v for k, v in first_rows.items() if v is not None and v[0].kind != "text"}
    if not first_rows:
        return
    from transformers import AutoTokenizer

    from hf_tp.data.formats import CHAT, IMAGES, PREFERENCE, encode_batch
    from hf_tp.data.formats.chat import check_chat_tokenizer
    from hf_tp.data.formats.tools import TOOLS_COLUMN, check_tools_template
    from hf_tp.data.places import RowPlaces

    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    for source, (fmt, row) in first_rows.items():
        if fmt.kind == IMAGES:
            continue  # rendered by the checkpoint's processor in the ranks (hf_tp.data.image_data)
        if fmt.kind == CHAT:
            check_chat_tokenizer(tokenizer)
            if TOOLS_COLUMN in row:
                check_tools_template(tokenizer)
        fmt = dataclasses.replace(fmt, assistant_only=cfg.assistant_only_loss)
        if fmt.kind == PREFERENCE:  # a prompt that fills --seq-len is a bad row
            fmt = dataclasses.replace(fmt, seq_len=cfg.seq_len)
        if cfg.skip_bad_rows:
            continue  # a first row the template rejects is dropped by the ranks, not an error
        split = cfg.split if source == cfg.dataset else cfg.eval_dataset_split
        places = RowPlaces(f"'{source}'", split)  # a sliced --split's first row named by its line
        encode_batch(fmt, {k: [v] for k, v in row.items()}, [0], tokenizer, f"'{source}'", places=places)


FIRST_IMAGE_ROWS = 16  # image rows encoded before launch (the ranks encode every row, naming a later bad one)
NO_IMAGE_EVAL = "hf_tp does not evaluate image + text data yet: drop --eval-split / --eval-dataset"


def image_rows_refusal(source: str, what: str) -> str:
    """The line for image + text rows read a way hf_tp does not read them yet (``--streaming``, ``a Hub dataset``)."""
    rows = f"dataset '{source}' holds image + text rows (messages and images columns)"
    if what == "--streaming":
        return f"{rows}, which --streaming does not read yet: drop --streaming"
    return f"{rows}, which hf_tp reads from local files only yet: download it and pass its path"


def check_image_data(cfg: TrainConfig, first_rows: dict, model_config: Any) -> None:
    """Image + text rows (``messages`` and ``images`` columns) before launch: what hf_tp cannot
    train them with (``--streaming``, an evaluation set, a Hub dataset, a model with no vision
    tower), then the first rows encoded by the checkpoint's processor, their images opened (a
    damaged image file, the image placeholder written as text: one line naming the row)."""
    from hf_tp.data.formats import IMAGES

    sources = [s for s, first in first_rows.items() if first is not None and first[0].kind == IMAGES]
    if not sources:
        return
    source = sources[0]
    rows = f"dataset '{source}' holds image + text rows (messages and images columns)"
    if source != cfg.dataset or cfg.has_eval:
        raise ValueError(NO_IMAGE_EVAL)
    if cfg.streaming:
        raise ValueError(image_rows_refusal(source, "--streaming"))
    if not Path(source).expanduser().exists():
        raise ValueError(image_rows_refusal(source, "a Hub dataset"))
    if getattr(model_config, "text_config", None) is None:
        raise ValueError(
            f"{rows}, but this {model_config.model_type} model has no vision tower: pass a multimodal checkpoint "
            "(e.g. a LLaVA or Qwen2-VL model), or data without an images column"
        )
    if not cfg.skip_bad_rows:
        _encode_first_image_rows(cfg, source)


def _encode_first_image_rows(cfg: TrainConfig, source: str) -> None:
    from transformers import AutoProcessor

    from hf_tp.data.datasets import load_text_dataset, quiet_datasets
    from hf_tp.data.image_data import dataset_dir, encode_image_dataset

    processor = AutoProcessor.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    settings = dict(seq_len=cfg.seq_len, assistant_only=cfg.assistant_only_loss, base_dir=dataset_dir(source))
    with quiet_datasets():  # no progress bars before launch
        raw = load_text_dataset(source, split=cfg.split, config_name=cfg.dataset_config)
        first = raw.select(range(min(FIRST_IMAGE_ROWS, len(raw))))
        encode_image_dataset(first, processor, label=f"'{source}'", **settings)
