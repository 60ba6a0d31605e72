"""Labels as HF causal LMs read them: one ignore index, one way to count the targets."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # the label that HF losses and F.cross_entropy skip


def count_targets(labels: torch.Tensor) -> int:
    """Tokens HF's causal-LM loss takes from ``labels``: it predicts ``labels[..., 1:]`` (the model
    shifts them by one inside) and skips ``IGNORE_INDEX`` (padding, masked prompts)."""
    return int((torch.as_tensor(labels)[..., 1:] != IGNORE_INDEX).sum())
