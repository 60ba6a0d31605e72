"""The data and evaluation flags of ``hf-tp train`` (kept apart: the data formats bring many)."""

from __future__ import annotations

from collections.abc import Callable


def add_data_arguments(p, default: Callable[[str], str]) -> None:
    """--dataset and how it is read: configuration, split, columns, labels, packing."""
    d = default
    p.add_argument(
        "--dataset",
        metavar="ID_OR_PATH",
        help="Hub dataset id, or a local .txt/.json/.jsonl/.parquet/.csv/.arrow file or directory of them; "
        "columns: text (documents), messages (chat) or prompt + completion (default: the embedded generated "
        "toy corpus, one document per line)",
    )
    p.add_argument("--dataset-config", metavar="NAME", help="the Hub dataset's configuration (default: none)")
    p.add_argument("--split", metavar="SPLIT", help=f"split to train on, slices too: train[:5%%] ({d('split')})")
    p.add_argument(
        "--text-column",
        metavar="NAME",
        help="the column of documents (plain text) (default: detected: text, else messages as chat, else "
        "prompt + completion)",
    )
    p.add_argument(
        "--messages-column",
        metavar="NAME",
        help="the column of conversations, lists of {role, content} rendered with the tokenizer's chat template "
        "(default: detected)",
    )
    _column_arguments(p)
    p.add_argument(
        "--assistant-only-loss",
        action="store_const",
        const=True,
        help="chat / prompt-completion data: train only on assistant turns / the completion (default: on)",
    )
    p.add_argument(
        "--no-assistant-only-loss",
        dest="assistant_only_loss",
        action="store_const",
        const=False,
        help="train on every token of the rendered conversation or pair",
    )
    p.add_argument("--seq-len", type=int, metavar="N", help=f"tokens per sequence ({d('seq_len')})")
    _packing_arguments(p)
    p.add_argument(
        "--streaming",
        action="store_const",
        const=True,
        help="read the dataset as a stream (datasets' IterableDataset), tokenizing and packing as it goes, in "
        "the dataset's order; checkpoints store the position, so --resume continues with the same batches "
        "(default: load, tokenize and shuffle the whole dataset first)",
    )
    p.add_argument(
        "--skip-bad-rows",
        action="store_const",
        const=True,
        help="drop malformed rows (wrong type, missing or empty fields, a conversation the chat template "
        "rejects) and report how many and which, instead of stopping before launch at the first one "
        "(default: stop)",
    )


def _column_arguments(p) -> None:
    """Columns under other names: preference pairs' prompt/chosen/rejected, tool-calling chat's tools."""
    for name, what in (
        ("prompt", "preference pairs: the column of prompts"),
        ("chosen", "preference pairs: the column of preferred completions"),
        ("rejected", "preference pairs: the column of rejected completions"),
        ("tools", "chat data: the column of each row's tool schemas, passed to the chat template"),
    ):
        p.add_argument(f"--{name}-column", metavar="NAME", help=f"{what} (default: {name})")


def _packing_arguments(p) -> None:
    """Whether documents are packed into --seq-len rows, and masked from each other there."""
    p.add_argument(
        "--pack",
        action="store_const",
        const=True,
        help="pack documents into --seq-len blocks (default for text, chat and prompt-completion data; "
        "preference pairs are never packed)",
    )
    p.add_argument(
        "--no-pack",
        dest="pack",
        action="store_const",
        const=False,
        help="one padded document per row (truncated to --seq-len) instead of documents packed into "
        "--seq-len blocks with EOS between them (default: pack)",
    )
    p.add_argument(
        "--no-document-masking",
        dest="document_masking",
        action="store_const",
        const=False,
        help="let packed documents attend to the ones before them in the row (default: each attends only to "
        "itself, through position_ids restarting per document)",
    )


def add_vision_arguments(p) -> None:
    """What trains of a multimodal checkpoint (docs/multimodal.md)."""
    p.add_argument(
        "--train-vision-tower",
        action="store_const",
        const=True,
        help="a multimodal checkpoint on image + text data: train its vision tower too (default: frozen; the "
        "projector and the language model train)",
    )


def add_eval_arguments(p, default: Callable[[str], str]) -> None:
    """Held-out evaluation during training."""
    d = default
    p.add_argument("--eval-dataset", metavar="ID_OR_PATH", help="evaluation data, read like --dataset (default: none)")
    p.add_argument("--eval-dataset-split", metavar="SPLIT", help=f"split of --eval-dataset ({d('eval_dataset_split')})")
    p.add_argument(
        "--eval-split",
        type=float,
        metavar="FRACTION",
        help="hold out this fraction of the training documents (chosen with --seed) for evaluation (default: 0)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        help="evaluate every N optimizer steps, and at the end; 0: only at the end (default: 0)",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        metavar="K",
        help="evaluate on the first K global batches of the eval set; 0: all of it (default: 0)",
    )


def add_objective_arguments(p, default: Callable[[str], str]) -> None:
    """The training objective: cross entropy, or a preference loss on prompt/chosen/rejected pairs."""
    d = default
    p.add_argument(
        "--objective",
        choices=("sft", "dpo", "simpo"),
        help="sft: next-token cross entropy; dpo: DPO's sigmoid loss on prompt/chosen/rejected pairs against a "
        "reference model (a frozen copy of the initial weights, or with --lora-r the base with the adapters off); "
        f"simpo: SimPO, length-normalised and reference-free (docs/post-training.md) ({d('objective')})",
    )
    p.add_argument("--beta", type=float, metavar="B", help=f"DPO / SimPO temperature, TRL's beta ({d('beta')})")
    p.add_argument(
        "--label-smoothing",
        type=float,
        metavar="E",
        help=f"DPO / SimPO: probability that a pair's preference is flipped, in [0, 0.5) ({d('label_smoothing')})",
    )
    p.add_argument("--simpo-gamma", type=float, metavar="G", help=f"SimPO's target reward margin ({d('simpo_gamma')})")
    p.add_argument(
        "--precompute-ref",
        action="store_const",
        const=True,
        help="dpo: compute the reference log-probs of every pair in one pass before training (the reference "
        "model is then freed; no reference forward per step) (default: a reference forward per micro-batch)",
    )
