"""DeepStack visual features on a sequence-sharded residual stream (Qwen3-VL, Qwen3-VL-MoE).

A DeepStack language model adds visual features into the hidden states of its first decoder
layers, at the image tokens' positions: transformers' ``_deepstack_process(hidden_states,
visual_pos_masks, visual_embeds)`` does ``hidden_states[visual_pos_masks, :] += visual_embeds``
after each of those layers. Under sequence parallelism the hidden states are a DTensor sharded
over the sequence (its global shape, each rank a slice), the mask and the features plain tensors
of the whole sequence, which boolean indexing cannot mix. Here the features are scattered into a
whole-sequence tensor (zero elsewhere, the same on every tp rank), laid out as the hidden states
(a local slice: no communication; its backward all-gathers the gradient, so the deepstack
mergers see the whole one, as the projector does) and added: at the visual positions the same
``h + v`` as transformers', elsewhere ``h + 0``, exactly ``h``. Under context parallelism the
mask covers the whole rows and the hidden states this rank's tokens: the whole-sequence tensor is
cut to them first (:class:`hf_tp.context.token_share.TokenShare`).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from hf_tp.compat.torch_fake import unset_fake_temporarily
from hf_tp.compat.transformers_private import DEEPSTACK, deepstack_merge, set_deepstack_merge
from hf_tp.context.token_share import TokenShare, state_of

ARGUMENTS = ("hidden_states", "visual_pos_masks", "visual_embeds")


def shard_deepstack(language_model: nn.Module) -> None:
    """Let ``language_model``'s DeepStack merge (if it has one) take sequence-sharded hidden states."""
    own = deepstack_merge(language_model)
    if own is None:
        return
    if tuple(inspect.signature(own).parameters)[1:] != ARGUMENTS or not _adds_at_positions(language_model, own):
        raise ValueError(
            f"hf_tp cannot place {type(language_model).__name__}'s DeepStack merge on sequence shards: its "
            f"{DEEPSTACK} is not the addition of {ARGUMENTS[2]} at {ARGUMENTS[1]} that hf_tp knows; "
            "pass sequence_parallel=False"
        )

    def process(hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, visual_embeds: torch.Tensor):
        state = state_of(language_model)
        layout = state.layout if state is not None and visual_pos_masks.shape[-1] != hidden_states.shape[1] else None
        if not isinstance(hidden_states, DTensor) and layout is None:
            return own(language_model, hidden_states, visual_pos_masks, visual_embeds)
        return hidden_states + sequence_addend(hidden_states, visual_pos_masks, visual_embeds, layout)

    set_deepstack_merge(language_model, process)


def _adds_at_positions(language_model: nn.Module, own) -> bool:
    """The model's merge adds the features at the masked positions (checked on a small example):
    only then may hf_tp add them on sequence shards instead."""
    with unset_fake_temporarily():  # real CPU tensors, also under hf-tp estimate's fake tensors
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, device="cpu")
        positions = torch.tensor([[True, False, True], [False, False, True]], device="cpu")
        values = torch.randn(3, 4, generator=g, dtype=torch.float64, device="cpu")
        want = hidden + torch.zeros_like(hidden).index_put((positions,), values)
        try:
            got = own(language_model, hidden.clone(), positions, values)
        except Exception:  # noqa: BLE001 - a merge that cannot run on plain tensors is one hf_tp does not know
            return False
        return isinstance(got, torch.Tensor) and torch.equal(got, want)


def sequence_addend(
    hidden_states: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, layout: TokenShare | None = None
) -> torch.Tensor:
    """``values`` (one row per True of ``positions``, row-major) at ``positions`` of a zero tensor of
    the whole rows, laid out as ``hidden_states``: this cp rank's tokens (``layout``, context
    parallelism: the mask covers the whole rows), then the hidden states' sequence shard over tp."""
    whole = torch.zeros((*positions.shape, hidden_states.shape[-1]), dtype=hidden_states.dtype, device=values.device)
    whole = whole.index_put((positions.to(values.device),), values.to(hidden_states.dtype))
    if layout is not None:
        whole = layout.take(whole)
    if not isinstance(hidden_states, DTensor):
        return whole
    mesh = hidden_states.device_mesh
    return DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
        mesh, hidden_states.placements
    )
