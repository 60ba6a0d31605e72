"""A multimodal wrapper's passengers under hf_tp: what it refuses, what trains, and where the
token stream is split.

hf_tp places a wrapper (:mod:`hf_tp.adapters.wrapper`) through its language model; the vision
(or audio) tower and the projector run whole on every tp rank (FSDP2 shards them over dp). The
tower is frozen by default (the usual VLM recipe: no gradient, no optimizer state), the
projector trains with the language model.

Image features are merged into the token embeddings *before* sequence parallelism splits the
sequence: a wrapper's embedding returns the full sequence (a plain tensor, the same on every tp
rank), the wrapper's own forward scatters the image features into it, and a pre-hook on the
language model turns ``inputs_embeds`` into a sequence-sharded DTensor, so the decoder layers see
exactly what the text path gives them.
"""

from __future__ import annotations

import ast
import re

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from hf_tp.adapters.adapter import Adapter
from hf_tp.core.forward_source import source_tree

# A passenger (or a module inside one) is a tower when its name says so; anything else (the
# projector, LLaVA-NeXT's image_newline, Qwen's vision merger) trains with the language model.
TOWER = re.compile(r"(vision|visual|audio|speech|image_encoder|tower|vqmodel|vq_model)")
# Qwen-VL / Qwen3.5 / GLM-4V keep the projector inside model.visual; Qwen3-VL also its DeepStack
# mergers (the same patch-merger module, one per tapped vision layer, writing into the hidden size)
PROJECTOR_INSIDE_TOWER = ("merger", "deepstack_merger_list")


def check_wrapper(model: nn.Module, adapter: Adapter, *, cp: bool) -> None:
    """Refuse, in one line, context parallelism on a wrapper whose forward builds its language
    model's attention masks itself (Gemma 3's and PaliGemma's: a mask per layer kind, bidirectional
    over image tokens): cp masks from global token indices and takes only a 2-D padding mask."""
    if not adapter.language_model or not cp:
        return
    builder = own_mask_builder(model, adapter.language_model)
    if builder is not None:
        raise ValueError(
            f"context parallelism (cp > 1) cannot split this multimodal {adapter.model_type} checkpoint: its "
            f"{builder} builds its language model's attention masks itself (one per layer kind, bidirectional "
            "over image tokens), which hf_tp's cp, masking from global token indices, does not reproduce; use --cp 1"
        )


MASK_BUILDER = re.compile(r"^create_\w*mask")  # transformers' masking_utils builders


def own_mask_builder(model: nn.Module, lm_path: str) -> str | None:
    """The class (wrapper, or a module between it and its language model) whose forward calls one of
    transformers' mask builders (``create_causal_mask``, ``create_masks_for_generate``, ...), else None."""
    parts = lm_path.split(".")
    for depth in range(len(parts)):
        module = model.get_submodule(".".join(parts[:depth]))
        tree = source_tree(type(module).forward)
        for node in ast.walk(tree) if tree is not None else ():
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if MASK_BUILDER.match(name):
                return f"{type(module).__name__}.forward ({name})"
    return None


def passenger_parameters(model: nn.Module, adapter: Adapter) -> list[tuple[str, nn.Parameter]]:
    """The wrapper's parameters outside its language model and lm_head (vision tower, projector)."""
    return [(n, p) for n, p in model.named_parameters() if adapter.is_passenger(n)]


def in_tower(adapter: Adapter, name: str) -> bool:
    """True for a parameter of a wrapper's vision (or audio) tower, not of its projector."""
    top = next((p for p in adapter.passengers if name == p or name.startswith(p + ".")), None)
    if top is None or not TOWER.search(top.rsplit(".", 1)[-1]):
        return False
    inner = name[len(top) + 1 :].split(".")
    return not any(part in PROJECTOR_INSIDE_TOWER for part in inner)


def freeze_passengers(model: nn.Module, adapter: Adapter, *, train_vision_tower: bool = False) -> int:
    """Freeze the wrapper's tower (unless ``train_vision_tower``); returns how many elements were frozen."""
    frozen = 0
    for name, p in passenger_parameters(model, adapter):
        if in_tower(adapter, name) and not train_vision_tower:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def describe(model: nn.Module, adapter: Adapter) -> str:
    """One line for a run's start: what trains and what is frozen."""
    params = passenger_parameters(model, adapter)
    frozen = sum(p.numel() for _, p in params if not p.requires_grad)
    trained = sorted({_part(adapter, n) for n, p in params if p.requires_grad})
    still = sorted({_part(adapter, n) for n, p in params if not p.requires_grad})
    tail = f"{', '.join(still)} ({frozen:,} parameters) frozen" if still else "nothing frozen"
    return (
        f"hf-tp: {adapter.model_type} is a multimodal checkpoint: training its language model "
        f"({adapter.language_model}), {', '.join(['lm_head', *trained])}; {tail}"
    )


def _part(adapter: Adapter, name: str) -> str:
    """The passenger a parameter belongs to, by its short name (a tower's projector named inside it)."""
    top = next(p for p in adapter.passengers if name == p or name.startswith(p + "."))
    short = top.rsplit(".", 1)[-1]
    if TOWER.search(short) and not in_tower(adapter, name):
        inner = name[len(top) + 1 :].split(".")
        return f"{short}.{next(p for p in inner if p in PROJECTOR_INSIDE_TOWER)}"
    return short


# Inputs of a wrapper's base model that carry no image (or audio, video) data: a call holding only
# these (and scalars, empty containers) keeps the text model's sequence-sharded embedding.
TEXT_INPUTS = frozenset(
    ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "past_key_values", "cache_position", "labels")
    + ("token_type_ids", "mm_token_type_ids", "use_cache", "return_dict", "logits_to_keep", "output_attentions")
    + ("output_hidden_states",)
)


def carries_images(kwargs: dict) -> bool:
    """A call of the wrapper's base model with anything beside text inputs (pixel values, image
    sizes, features transformers encoded ahead of generate's first forward, ...)."""
    return any(
        k not in TEXT_INPUTS
        and v is not None
        and not isinstance(v, (bool, int, float, str))
        and not (isinstance(v, (dict, list, tuple)) and not v)
        for k, v in kwargs.items()
    )


def split_at_language_model(model: nn.Module, adapter: Adapter, tp_mesh: DeviceMesh) -> None:
    """Merge image features into the whole sequence, then split it at the language model's entry.

    The embedding keeps the text model's plan (a sequence-sharded DTensor out of a reduce-scatter).
    For a call of the wrapper (or its base model) that carries images, a hook makes it whole (plain, the
    same on every tp rank: one all-gather; backward a local slice), so the wrapper's own forward
    scatters the image features into it; a pre-hook on the language model then turns the merged
    ``inputs_embeds`` into ``Shard(1)`` again (a local slice, no communication; its backward
    all-gathers the gradient, which every tp rank then holds whole for the projector and tower).
    Text-only calls run exactly the text model's path. A language model called with
    ``input_ids`` gets them embedded here.
    """
    lm = model.get_submodule(adapter.language_model)
    embedding = model.get_input_embeddings()
    base = model.get_submodule(adapter.language_model.rpartition(".")[0])

    calls: list[bool] = []  # the wrapper's and its base model's calls under way: whether each carries images

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append(carries_images(kwargs) or any(isinstance(a, torch.Tensor) for a in args[1:]))

    def leave(*_) -> None:
        if calls:
            calls.pop()

    def whole(module: nn.Module, args: tuple, output):
        return output.full_tensor() if any(calls) and isinstance(output, DTensor) else None

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            ids = kwargs.get("input_ids")
            if ids is None and args:  # input_ids passed by position (HF passes keywords)
                ids, args = args[0], (None, *args[1:])
            elif ids is not None:
                kwargs = {**kwargs, "input_ids": None}
            if ids is None:
                return None
            embeds = module.get_input_embeddings()(ids)
        if not isinstance(embeds, DTensor):
            embeds = DTensor.from_local(embeds, tp_mesh, [Replicate()], run_check=False).redistribute(
                tp_mesh, [Shard(1)]
            )
        return args, {**kwargs, "inputs_embeds": embeds}

    for entry in {id(m): m for m in (model, base)}.values():  # the fused loss calls the base model itself
        entry.register_forward_pre_hook(enter, with_kwargs=True)
        entry.register_forward_hook(leave, always_call=True)
    embedding.register_forward_hook(whole)
    lm.register_forward_pre_hook(hook, with_kwargs=True)
    _whole_rows_before_language_model(model, adapter.language_model)


class _WholeWhere(TorchFunctionMode):
    """``torch.where`` of a plain tensor and a DTensor runs on the DTensor made whole."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.where, torch.Tensor.where):
            values = (*args, *kwargs.values())
            if any(isinstance(a, DTensor) for a in values) and any(
                isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.dim() > 0 for a in values
            ):
                args = tuple(a.full_tensor() if isinstance(a, DTensor) else a for a in args)
                kwargs = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _whole_rows_before_language_model(model: nn.Module, lm_path: str) -> None:
    """Let the wrapper's own forward mix a row of a tensor-parallel parameter into the plain
    full-sequence embeddings before its language model runs.

    Gemma 4's forward puts the pad token's row of the (vocab-sharded) input embedding at its image
    positions with ``torch.where`` before the per-layer embeddings; that row is a DTensor, the
    embeddings a plain tensor. Between the wrapper's entry and its language model's (and only for
    a wrapper whose forward indexes a ``weight``), such a ``torch.where`` takes the row whole.
    """
    parent = model.get_submodule(lm_path.rpartition(".")[0])
    tree = source_tree(type(parent).forward)
    if tree is None or not any(
        isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "weight"
        for n in ast.walk(tree)
    ):
        return
    active: list[TorchFunctionMode] = []  # per thread: torch keeps its function-mode stack per thread

    def enter(*_):
        mode = _WholeWhere()
        mode.__enter__()
        active.append(mode)

    def leave(*_):
        if active:
            active.pop().__exit__(None, None, None)

    parent.register_forward_pre_hook(enter)
    parent.register_forward_hook(leave, always_call=True)
    model.get_submodule(lm_path).register_forward_pre_hook(leave, prepend=True)
