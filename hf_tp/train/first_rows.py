"""Before launch, the first row of each dataset against the objective and the tokenizer (what the
rows alone cannot decide: the chat template, the tokenizer's offsets)."""

from __future__ import annotations

import dataclasses

from hf_tp.data.formats.preference import check_objective_data
from hf_tp.train.config import TrainConfig


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
