"""The reference model of a preference objective, as per-sequence log-probs without gradients.

Two kinds, one call: :class:`FrozenCopy`, a second model loaded from the same checkpoint and
sharded exactly like the policy (same mesh, plan, FSDP2 over dp; no gradients, no optimizer
state), or :class:`AdaptersOff`, the LoRA policy itself with its adapters switched off for the
reference forward, which is the frozen base (no second copy). Under pipeline parallelism either
runs through pipeline stages (:class:`StagedReference`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from hf_tp.compat.peft_private import adapters_disabled, has_adapter_switch, set_adapters_disabled
from hf_tp.moe.pipeline_aux import stage_outputs
from hf_tp.parallel.logps import logits_log_probs, sequence_log_probs
from hf_tp.pipeline.schedules import Pipeline


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
        with torch.no_grad(), self.off():
            return sequence_log_probs(self.policy, model_inputs(batch)).logps

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """The policy's adapters switched off inside the block."""
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


class StagedReference:
    """A reference run through pipeline stages (``--pp``): a frozen copy pipelined like the policy,
    or (``adapters_off``) the LoRA policy's own stages with their adapters switched off. The last
    stage's logits give the rows' log-probs, which every pp rank receives (collective over the
    pipeline: every rank calls it, before the policy's step runs the stages)."""

    def __init__(self, pipe: Pipeline, adapters_off: bool = False) -> None:
        self.pipe = pipe
        self.adapters = AdaptersOff(nn.ModuleList(pipe.models)) if adapters_off else None
        if not adapters_off:
            for model in pipe.models:
                model.requires_grad_(False).eval()

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pipe = self.pipe
        logps = torch.zeros(batch["input_ids"].shape[0], device=pipe.device)
        with torch.no_grad(), self.adapters.off() if self.adapters else contextlib.nullcontext():
            for module, out, _ in stage_outputs(pipe, model_inputs(batch)):
                if module.last:
                    logps = logits_log_probs(module.model, out, batch["labels"]).logps
        last = dist.get_global_rank(pipe.group, pipe.stage_rank(pipe.num_stages - 1))
        dist.broadcast(logps, src=last, group=pipe.group)
        return logps
