"""The random model and the batch ``hf-tp verify`` trains: the same on every rank (seeded), the
model saved as a ``from_pretrained`` folder so the layout under test loads it as training does."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from hf_tp.labels import IGNORE_INDEX


def random_model(config: PretrainedConfig, seed: int) -> nn.Module:
    """The model of ``config`` in fp32 with seeded random weights. HF leaves 1-D parameters at
    ones and zeros and some routers at zero; drawn at random here, so a bias or norm weight not
    sharded with its module, or a router gradient, shows in the comparison."""
    from hf_tp.core.model_source import model_from_config

    torch.manual_seed(seed)
    model = model_from_config(config, dtype=torch.float32)
    with torch.no_grad():
        draw_index_tables(model, config)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
            elif name.endswith("_bias"):  # experts' biases [experts, features], zero at init
                p.normal_(0.0, 0.1)
            elif name.endswith("gate.weight") and not p.any():  # a router left at zeros: every expert ties
                p.normal_(0.0, config.initializer_range)
    return model.train()


def draw_index_tables(model: nn.Module, config: PretrainedConfig) -> None:
    """A token -> experts table (DeepSeek-V4's hash routing ``tid2eid``: an integer buffer of
    ``[vocab, k]``) that the config's init leaves at zeros until a checkpoint loads it: drawn as a
    trained table is, ``k`` distinct experts per token. (At zeros every token goes ``k`` times to
    expert 0, its routing weights are constant and the gate's gradient is round-off.) Other
    integer buffers are left as the init makes them. Draws from the CPU RNG."""
    from hf_tp.core.module_queries import num_experts

    text = config.get_text_config()
    experts = num_experts(text)
    for buf in model.buffers():
        table = buf.dim() == 2 and not buf.dtype.is_floating_point and buf.dtype != torch.bool
        if experts and table and buf.shape[0] == text.vocab_size and buf.shape[1] <= experts and not buf.any():
            buf.copy_(torch.rand(buf.shape[0], experts).argsort(-1)[:, : buf.shape[1]])


def save_model(model: nn.Module, folder: Path) -> Path:
    """``model`` as a safetensors folder (config and generation config included)."""
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_batch(vocab: int, rows: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """``rows`` random rows of ``seq_len`` tokens; the last row right-padded by a quarter (mask 0,
    labels ignored), as the collator pads short rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq_len), generator=g)
    mask = torch.ones(rows, seq_len, dtype=torch.long)
    if rows > 1:
        mask[-1, seq_len - seq_len // 4 :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def targets(batch: dict[str, torch.Tensor]) -> int:
    """The tokens the loss scores (HF's causal shift: a row's first label is never a target)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
