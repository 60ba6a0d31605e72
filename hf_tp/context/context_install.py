"""Turning a model context parallel: the checks, the attention function, and the forward hooks
that give each rank its tokens (:mod:`hf_tp.context.token_share` has the mechanism)."""

from __future__ import annotations

import ast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hf_tp.context.token_share import (
    ATTENTION_NAME,
    ContextState,
    cp_attention,
    shift_labels,
    state_of,
    sum_over_cp,
)
from hf_tp.core.dims import row_multiple
from hf_tp.core.forward_source import source_tree
from hf_tp.core.record import facts, facts_of, record_of
from hf_tp.labels import IGNORE_INDEX

# Sequence mixers that are not attention: their tokens meet outside the attention function, so a
# rank holding part of the sequence would compute them wrong (Mamba, short convolutions, linear
# attention all carry a causal conv1d or a recurrent state; DeepSeek-V4's compressors pool every
# compress_rate tokens of the whole sequence into one key before attention).
# Matched case-sensitively in class names ("SSM" must not match "CompassMLP").
_NOT_ATTENTION = (
    "Mamba", "DeltaNet", "ShortConv", "LinearAttention", "Lightning", "SSM", "Rwkv", "RWKV", "Retention", "Compressor",
)  # fmt: skip
_KERNELS = ("sdpa", "eager")


def check_context_parallel(model: nn.Module, layers_path: str, cp: int) -> None:
    """Refuse, before anything changes, a model whose attention context parallelism cannot make
    exact: token mixing outside attention, chunked attention, a kernel other than SDPA or eager."""
    config = decoder_config(model)
    kind = config.model_type
    base = getattr(config, "_attn_implementation", None) or "eager"
    if base == ATTENTION_NAME:
        raise ValueError(
            "this model's config object was already made context parallel by hf_tp (models built from one "
            "config object share it); build each model from its own config (copy.deepcopy(config))"
        )
    if base not in _KERNELS:
        raise ValueError(
            f"context parallelism (cp={cp}) runs the model's attention as 'sdpa' or 'eager', but this model "
            f"uses attn_implementation='{base}'; load it with attn_implementation='sdpa'"
        )
    if getattr(config, "attention_chunk_size", None):
        raise ValueError(
            f"cp={cp}: {kind} uses chunked attention (attention_chunk_size), which hf_tp's cp does not mask; use --cp 1"
        )
    for name, module in model.get_submodule(layers_path).named_modules():
        cls = type(module).__name__
        if "Indexer" in cls:
            raise ValueError(
                f"cp={cp}: {kind}'s sparse-attention indexer ({cls} at layers.{name}) selects keys from the whole "
                "attention mask, which hf_tp's cp does not split; use --cp 1"
            )
        if isinstance(module, nn.Conv1d) or any(word in cls for word in _NOT_ATTENTION):
            raise ValueError(
                f"cp={cp}: {kind} mixes tokens outside attention ({type(module).__name__} at layers.{name}), which "
                "needs the whole sequence on one rank; use --cp 1 (tensor parallelism still splits it)"
            )


def install_context_parallel(model: nn.Module, layers_path: str, cp_mesh: DeviceMesh, tp: int) -> ContextState:
    """Make ``model`` context parallel over ``cp_mesh`` (after tensor parallelism, before FSDP2)."""
    from transformers import AttentionInterface

    config = decoder_config(model)
    state = ContextState(
        mesh=cp_mesh, base=config._attn_implementation or "eager", multiple=row_multiple(tp, cp_mesh.size())
    )
    state.documents = masks_documents(model.get_decoder())
    AttentionInterface.register(ATTENTION_NAME, cp_attention)
    config._attn_implementation = ATTENTION_NAME  # (a wrapper's vision tower keeps its own kernel)
    layers = model.get_submodule(layers_path)
    for module in [*layers.modules(), model.get_decoder()]:  # read by cp_attention, a DeepStack merge
        facts(module).cp = state
    record_of(model).cp = state
    # first of the decoder's pre-hooks: a wrapper's (hf_tp.multimodal.passengers) then shard this rank's tokens over tp
    model.get_decoder().register_forward_pre_hook(_split_inputs(state), with_kwargs=True, prepend=True)
    stage = getattr(facts_of(model), "stage", None)  # a pipeline stage checks its own layers only
    ran = {i: x for i, x in enumerate(layers) if stage is None or i in stage.layers}
    model.get_decoder().register_forward_hook(_check_attention_ran(state, ran))
    model.register_forward_pre_hook(_split_labels(state, model), with_kwargs=True)
    model.register_forward_pre_hook(_hold_padding(state, model), with_kwargs=True)
    model.register_forward_hook(_whole_loss)
    return state


def decoder_config(model: nn.Module):
    """The config of the model's decoder: a causal LM's own; a multimodal wrapper's text config
    (setting the attention kernel on the wrapper's config would set it on its vision tower too)."""
    return getattr(model.get_decoder(), "config", None) or model.config


def masks_documents(decoder: nn.Module) -> bool:
    """Whether the decoder hands ``position_ids`` to transformers' mask builders, which then mask
    packed documents from each other. Families that do not (GPT-OSS, AFMoE in 5.24) let
    packed documents attend to each other in plain HF; cp keeps each family's own behaviour.
    (Read from the forward's source: neither library says it. Unreadable: assumed to mask.)"""
    tree = source_tree(type(decoder).forward)
    if tree is None:
        return True
    dicts = {}  # mask_kwargs = {...}: name -> its keys
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            dicts.update({t.id: keys for t in node.targets if isinstance(t, ast.Name)})
    builders = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and "mask" in ast.unparse(n.func)]
    for call in builders:
        for kw in call.keywords:
            if kw.arg == "position_ids" or (kw.arg is None and "position_ids" in dicts.get(ast.unparse(kw.value), ())):
                return True
    return not builders


def packed_documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document ids of packed rows (a new document wherever the position does not go up by one),
    None when every row is one document: HF's rule for position_ids without an attention_mask.
    (Written out: transformers' own helper is private and absent from some 5.x releases.)"""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    docs = (step != 1).cumsum(-1)
    return None if bool((docs[:, -1] == 0).all()) else docs


def _split_inputs(state: ContextState):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        kwargs = dict(kwargs)
        if args:  # decoder(input_ids, ...) called positionally
            kwargs["input_ids"], args = args[0], args[1:]
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise ValueError("context parallelism trains on whole rows; it takes no KV cache (generate with cp=1)")
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        x = ids if ids is not None else embeds
        mask, pos = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if mask is None:  # the one the model's forward was given (_hold_padding), used once
            mask, state.padding = state.padding, None
        _check_padding_mask(module, mask)
        docs = _documents(pos) if pos is not None and mask is None and state.documents else None
        staged = ids is None and state.stage_seq > 0  # a pipeline stage fed this rank's tokens (the previous stage's)
        seq = state.stage_seq if staged else x.shape[1]
        if pos is None:
            pos = torch.arange(seq, device=x.device)[None]
        state.start(seq, mask, docs, x.device)
        # (B, S), or a multimodal wrapper's 3-D mrope positions (3 or 4, B, S): the sequence is last
        kwargs.update(attention_mask=None, position_ids=state.layout.take(pos, dim=-1), use_cache=False)
        kwargs.pop("cache_position", None)
        if ids is not None:
            kwargs["input_ids"] = state.layout.take(ids)
        elif not staged:  # a wrapper's merged embeddings; under tp its text-only path hands them sequence-sharded
            whole = embeds.full_tensor() if isinstance(embeds, DTensor) else embeds
            kwargs["inputs_embeds"] = state.layout.take(whole)
        return args, kwargs

    return hook


def _check_padding_mask(module: nn.Module, mask) -> None:
    """cp masks from global indices: it takes a 2-D padding mask, nothing a model built itself."""
    if mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        return
    what = f"{mask.dim()}-D" if isinstance(mask, torch.Tensor) else f"a {type(mask).__name__} of masks"
    raise ValueError(
        f"context parallelism takes a 2-D attention_mask (padding), but {type(module).__name__} is given {what} "
        "(a multimodal wrapper's own masks, such as bidirectional attention over image tokens, cannot be split); "
        "use --cp 1"
    )


def _documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Packed documents from ``position_ids``: (B, S), or the text row of the 4-row mrope form
    (text, temporal, height, width); 3 rows carry no text positions, so HF masks no documents."""
    if position_ids.dim() == 3:
        return packed_documents(position_ids[0]) if position_ids.shape[0] == 4 else None
    return packed_documents(position_ids)


def _check_attention_ran(state: ContextState, layers: dict[int, nn.Module]):
    """After a forward: its masks dropped, and every decoder layer attended through hf_tp's
    function (else its tokens would have met some other way, or not at all)."""

    def hook(module: nn.Module, args, output) -> None:
        state.finish()
        missing = [i for i, layer in layers.items() if not any(id(m) in state.called for m in layer.modules())]
        if missing:
            raise ValueError(
                f"context parallelism: decoder layers {missing[:8]} of {type(module).__name__} did not call "
                "transformers' attention interface, so cp cannot split their sequence; use --cp 1"
            )

    return hook


def _split_labels(state: ContextState, model: nn.Module):
    """``labels`` -> this rank's shifted targets (``shift_labels``), the count over whole rows."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        labels = kwargs.get("labels")
        if labels is None:
            return None
        if kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False)):
            raise ValueError(
                "with cp > 1 the router aux loss HF adds inside forward would cover this rank's tokens only; "
                "train with hf_tp.fit / hf-tp train (which reduce it over the whole rows) or pass output_router_logits=False"
            )
        kwargs = dict(kwargs)
        shifted = kwargs.get("shift_labels")
        shifted = shift_labels(labels) if shifted is None else shifted
        if kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
        local = state.layout.take(shifted)
        kwargs.update(labels=local, shift_labels=local)
        return args, kwargs

    return hook


def _hold_padding(state: ContextState, model: nn.Module):
    """A forward that records router logits: its ``attention_mask`` goes to the decoder through
    ``state``, not the forward, whose HF aux loss (which hf_tp does not use: it reduces its own
    over the whole rows, :mod:`hf_tp.moe.aux_loss`) would pair the whole rows' mask with this
    rank's router logits and fail on the shapes."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        state.padding = None
        if not kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False)):
            return None
        kwargs = dict(kwargs)
        state.padding = kwargs.pop("attention_mask", None)
        return args, kwargs

    return hook


def _whole_loss(module: nn.Module, args, output):
    loss = getattr(output, "loss", None)
    if loss is not None:
        output.loss = sum_over_cp(module, loss)
    return output


__all__ = ["check_context_parallel", "install_context_parallel", "packed_documents", "state_of"]
