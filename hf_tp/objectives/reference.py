"""The reference model of a preference objective, as per-sequence log-probs without gradients.

Two kinds, one call: :class:`FrozenCopy`, a second model loaded from the same checkpoint and
sharded exactly like the policy (same mesh, plan, FSDP2 over dp; no gradients, no optimizer
state), or :class:`AdaptersOff`, the LoRA policy itself with its adapters switched off for the
reference forward, which is the frozen base (no second copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hf_tp.compat.peft_private import adapters_disabled, has_adapter_switch, set_adapters_disabled
from hf_tp.parallel.logps import sequence_log_probs


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model inputs of a pair batch (no ``row_lengths``, no stored ``ref_logps``)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "labels") if k in batch}


class FrozenCopy:
    """Log-probs from a frozen copy of the initial policy (put in eval mode: no dropout)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.requires_grad_(False).eval()

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return sequence_log_probs(self.model, model_inputs(batch)).logps


class AdaptersOff:
    """Log-probs of the policy's frozen base: its peft LoRA layers switched off for the call."""

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy
        self.layers = [m for m in policy.modules() if has_adapter_switch(m) and hasattr(m, "lora_A")]
        if not self.layers:
            raise ValueError("the adapter-off reference needs a model with peft LoRA layers (--lora-r)")

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad(), self._off():
            return sequence_log_probs(self.policy, model_inputs(batch)).logps

    @contextlib.contextmanager
    def _off(self) -> Iterator[None]:
        # The flag peft's forward reads; set directly, since peft's enable_adapters(False) also
        # flips requires_grad on the adapters, which must stay trainable.
        saved = [adapters_disabled(layer) for layer in self.layers]
        for layer in self.layers:
            set_adapters_disabled(layer, True)
        try:
            yield
        finally:
            for layer, flag in zip(self.layers, saved, strict=True):
                set_adapters_disabled(layer, flag)
