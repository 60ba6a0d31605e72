"""Before launch: does a step fit the data and the machine? Closed forms, no model built, answered
in well under a second (``hf-tp estimate`` simulates a step for real; this only catches a step
that cannot possibly fit).

- The global batch against the dataset: a local dataset with fewer examples than one step's batch
  (an upper bound: its rows, or with packing its bytes over ``--seq-len``) is refused, naming both.
- A step's memory against this machine's: weights, gradients and AdamW states of a rank's share,
  and the activations of its micro-batch, summed over the ranks of a CPU node (or per GPU): far
  beyond the machine's memory is refused, beyond it warned.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from hf_tp.run.config import TrainConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GiB = 1024**3
FAR_BEYOND = 2.0  # refused above this many times the machine's memory; warned above 1x
ROW_SPECIAL_TOKENS = 8  # tokens a row may add beyond one per byte (bos, eos, a prefix space)
TEMPLATE_BYTES = 4  # a chat template's text, per byte of the row's content, at most (generous)


def check_batch_fits(cfg: TrainConfig) -> None:
    """A local, non-streamed dataset holds at least one global batch of examples."""
    path = Path(cfg.dataset).expanduser() if cfg.dataset else None
    if cfg.streaming or path is None or not path.exists():
        return
    from hf_tp.data.datasets import load_text_dataset

    ds = load_text_dataset(cfg.dataset, split=cfg.split)  # the cache the check of its rows made
    rows = training_rows(len(ds), cfg.eval_split, f"'{cfg.dataset}'")
    if cfg.global_batch <= rows:
        return
    what = f"{rows} rows" + (
        f" for training (--eval-split {cfg.eval_split} holds out the rest)" if cfg.eval_split else ""
    )
    bound = rows
    if cfg.packs and cfg.objective == "sft":
        bound = _packed_bound(ds, cfg) * rows // len(ds)
        what += f" (at most {bound} packed sequences of {cfg.seq_len} tokens)"
    if cfg.global_batch <= bound:
        return
    unit = "sequences" if cfg.objective == "sft" else "preference pairs"
    raise ValueError(
        f"the global batch ({cfg.global_batch} {unit}: --batch-size {cfg.batch_size} x dp {cfg.dp} x grad-accum "
        f"{cfg.grad_accum}) is larger than dataset '{cfg.dataset}', which holds {what}; lower --batch-size, "
        "or add data"
    )


def training_rows(rows: int, eval_split: float, label: str) -> int:
    """The rows left for training after ``--eval-split`` holds out its share (as ``datasets``'
    ``train_test_split`` rounds: the held-out count up); ``ValueError`` when none is left."""
    held = math.ceil(rows * eval_split) if eval_split else 0
    if rows - held < 1:
        raise ValueError(
            f"--eval-split {eval_split} holds out {held} of dataset {label}'s {rows} rows and leaves none for "
            "training; lower --eval-split (0.05 is usual), or pass --eval-dataset"
        )
    return rows - held


def _packed_bound(ds, cfg: TrainConfig) -> int:
    """Packed sequences a dataset of few rows can give at most: every byte a token, plus a row's
    special tokens (text), or a chat template's text around it (other formats)."""
    import pyarrow.compute as pc

    text = cfg.text_column or "text"
    if text in ds.column_names and len(ds.column_names) == 1:
        column = ds.data.column(text)
        tokens = int(pc.sum(pc.binary_length(pc.cast(column, "large_binary"))).as_py() or 0)
    else:
        tokens = sum(len(str(row).encode()) * TEMPLATE_BYTES for row in ds)
    return -(-(tokens + ROW_SPECIAL_TOKENS * len(ds)) // max(1, cfg.seq_len))


def parameter_count(config: PretrainedConfig) -> tuple[int, int]:
    """(parameters, of them expert parameters) of a decoder-only model, from its config."""
    text = getattr(config, "text_config", None) or config
    h, layers = text.hidden_size, text.num_hidden_layers
    heads = getattr(text, "num_attention_heads", 1) or 1
    head_dim = getattr(text, "head_dim", None) or h // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    attention = h * head_dim * (2 * heads + 2 * kv)
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    experts = experts or getattr(text, "n_routed_experts", None) or 0
    width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    expert = 3 * h * width * experts * layers
    dense = 0 if experts else 3 * h * text.intermediate_size
    embed = text.vocab_size * h * (1 if getattr(text, "tie_word_embeddings", False) else 2)
    return embed + layers * (attention + dense) + expert, expert


def step_memory(cfg: TrainConfig, config: PretrainedConfig, dtype: str) -> dict[str, int]:
    """A rank's bytes in one step, by part: its share of weights + gradients + AdamW (fp32), and a
    micro-batch's activations (what autograd keeps per layer: about 10 hidden-sized and 4
    MLP-sized tensors per token, split over tp and cp; a layer's input only with recompute) plus
    its logits."""
    text = getattr(config, "text_config", None) or config
    params, experts = parameter_count(config)
    trained = 16 if not cfg.lora_r else 4  # fp32 weight, gradient, two AdamW moments; a frozen base
    states = params * trained // (cfg.tp * cfg.pp * cfg.dp)  # (ep splits the experts within dp)
    size = 2 if dtype == "bf16" else 4
    tokens = (cfg.batch_size or 1) * cfg.seq_len // cfg.cp
    top_k = getattr(text, "num_experts_per_tok", None) or 1
    width = (getattr(text, "moe_intermediate_size", None) or text.intermediate_size) * (top_k if experts else 1)
    per_token = text.hidden_size if cfg.activation_checkpointing else 10 * text.hidden_size + 4 * width
    layers = -(-text.num_hidden_layers // cfg.pp)
    activations = tokens * layers * per_token * size // cfg.tp
    logits = tokens * -(-text.vocab_size // cfg.tp) * 4
    return {"weights, gradients and AdamW": states, "activations": activations, "logits": logits}


def machine_memory(device_type: str) -> int | None:
    """Bytes of this machine's memory a rank may use: one GPU's, or the host's RAM; None if unknown."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_step_memory(
    cfg: TrainConfig, config: PretrainedConfig, device_type: str, have: int | None = None
) -> str | None:
    """``ValueError`` when a step needs far more memory than this machine has; a warning (returned)
    when it needs more; None when it fits. ``have``: the machine's bytes (default: measured)."""
    have = machine_memory(device_type) if have is None else have
    if not have:
        return None
    parts = step_memory(cfg, config, cfg.compute_dtype_name(device_type))
    rank = sum(parts.values())
    ranks = 1 if device_type == "cuda" else max(1, cfg.world_size // cfg.nnodes)
    need = rank * ranks
    if need <= have:
        return None
    where = "one GPU" if device_type == "cuda" else f"{ranks} rank{'s' if ranks > 1 else ''} on this machine"
    split = ", ".join(f"{name} {value / GiB:.1f}" for name, value in parts.items())
    text = (
        f"a step needs about {need / GiB:.1f} GiB on {where} ({split} GiB per rank, at --batch-size "
        f"{cfg.batch_size} x --seq-len {cfg.seq_len}), {'far ' if need > FAR_BEYOND * have else ''}beyond its "
        f"{have / GiB:.1f} GiB; lower --batch-size (--grad-accum keeps the global batch) or --seq-len, or pass "
        "--activation-checkpointing"
    )
    if need > FAR_BEYOND * have:
        raise ValueError(text)
    return text
