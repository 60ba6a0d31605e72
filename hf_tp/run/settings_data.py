"""The settings of what a run trains on and what it optimises: model and data, held-out evaluation,
the objective. Each group is one flag group of ``hf-tp train --help``; ``TrainConfig`` has them all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hf_tp.core.setting import setting

OBJECTIVES = ("sft", "dpo", "simpo")  # cross entropy; preference losses on pairs (hf_tp.objectives)


@dataclass
class ModelAndData:
    TITLE: ClassVar[str] = "model and data"

    model: str | None = setting(
        None,
        "Hub id (e.g. Qwen/Qwen2-0.5B) or local dir, loaded with from_pretrained, tokenizer included "
        "(default: the embedded tiny Llama, ~150k random-init parameters built locally under ~/.cache/hf_tp "
        "or $HF_TP_CACHE)",
        metavar="ID_OR_DIR",
    )
    trust_remote_code: bool = setting(
        False,
        "let a model whose config.json's auto_map names classes transformers does not have run that Python "
        "code, on every rank; read it first (default: off, such a model is refused before launch; a model "
        "transformers has is always built from transformers' own classes)",
    )
    dataset: str | None = setting(
        None,
        "Hub dataset id, or a local .txt/.json/.jsonl/.parquet/.csv/.arrow file or directory of them; "
        "columns: text (documents), messages (chat) or prompt + completion (default: the embedded generated "
        "toy corpus, one document per line)",
        metavar="ID_OR_PATH",
    )
    dataset_config: str | None = setting(None, "the Hub dataset's configuration (default: none)", metavar="NAME")
    split: str = setting("train", "split to train on, slices too: train[:5%%]", metavar="SPLIT")
    text_column: str | None = setting(
        None,
        "the column of documents (plain text) (default: detected: text, else messages as chat, else "
        "prompt + completion)",
        metavar="NAME",
    )
    messages_column: str | None = setting(
        None,
        "the column of conversations, lists of {role, content} rendered with the tokenizer's chat template "
        "(default: detected)",
        metavar="NAME",
    )
    prompt_column: str | None = setting(
        None, "preference pairs: the column of prompts (default: prompt)", metavar="NAME"
    )
    chosen_column: str | None = setting(
        None, "preference pairs: the column of preferred completions (default: chosen)", metavar="NAME"
    )
    rejected_column: str | None = setting(
        None, "preference pairs: the column of rejected completions (default: rejected)", metavar="NAME"
    )
    tools_column: str | None = setting(
        None,
        "chat data: the column of each row's tool schemas, passed to the chat template (default: tools)",
        metavar="NAME",
    )
    assistant_only_loss: bool = setting(
        True,
        "chat / prompt-completion data: train only on assistant turns / the completion (default: on)",
        no_help="train on every token of the rendered conversation or pair (default: off)",
    )
    seq_len: int | None = setting(None, "tokens per sequence", metavar="N")
    pack: bool | None = setting(
        None,
        "pack documents into --seq-len blocks (default for text, chat and prompt-completion data; "
        "preference pairs are never packed)",
        no_help="one padded document per row (truncated to --seq-len) instead of documents packed into "
        "--seq-len blocks with EOS between them (default: pack)",
    )
    streaming: bool = setting(
        False,
        "read the dataset as a stream (datasets' IterableDataset), tokenizing and packing as it goes, in "
        "the dataset's order; checkpoints store the position, so --resume continues with the same batches "
        "(default: load, tokenize and shuffle the whole dataset first)",
    )
    skip_bad_rows: bool = setting(
        False,
        "drop malformed rows (wrong type, missing or empty fields, a conversation the chat template "
        "rejects) and report how many and which, instead of stopping before launch at the first one "
        "(default: stop)",
    )
    document_masking: bool = setting(
        True,
        no_help="let packed documents attend to the ones before them in the row (default: each attends only to "
        "itself, through position_ids restarting per document)",
    )
    train_vision_tower: bool = setting(
        False,
        "a multimodal checkpoint on image + text data: train its vision tower too (default: frozen; the "
        "projector and the language model train)",
    )


@dataclass
class HeldOutEval:
    TITLE: ClassVar[str] = "held-out evaluation"

    eval_dataset: str | None = setting(
        None, "evaluation data, read like --dataset (default: none)", metavar="ID_OR_PATH"
    )
    eval_dataset_split: str = setting("train", "split of --eval-dataset", metavar="SPLIT")
    eval_split: float = setting(
        0.0,
        "hold out this fraction of the training documents (chosen with --seed) for evaluation (default: 0)",
        metavar="FRACTION",
    )
    eval_every: int = setting(
        0, "evaluate every N optimizer steps, and at the end; 0: only at the end (default: 0)", metavar="N"
    )
    eval_batches: int = setting(
        0, "evaluate on the first K global batches of the eval set; 0: all of it (default: 0)", metavar="K"
    )


@dataclass
class ObjectiveSettings:
    TITLE: ClassVar[str] = "objective (preference training: docs/post-training.md)"

    objective: str = setting(
        "sft",
        "sft: next-token cross entropy; dpo: DPO's sigmoid loss on prompt/chosen/rejected pairs against a "
        "reference model (a frozen copy of the initial weights, or with --lora-r the base with the adapters off); "
        "simpo: SimPO, length-normalised and reference-free (docs/post-training.md)",
        choices=OBJECTIVES,
    )
    beta: float = setting(0.1, "DPO / SimPO temperature, TRL's beta", metavar="B")
    label_smoothing: float = setting(
        0.0, "DPO / SimPO: probability that a pair's preference is flipped, in [0, 0.5)", metavar="E"
    )
    simpo_gamma: float = setting(0.5, "SimPO's target reward margin", metavar="G")
    precompute_ref: bool = setting(
        False,
        "dpo: compute the reference log-probs of every pair in one pass before training (the reference "
        "model is then freed; no reference forward per step) (default: a reference forward per micro-batch)",
    )
