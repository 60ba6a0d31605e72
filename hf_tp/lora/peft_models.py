"""peft LoRA models under :func:`hf_tp.parallelize`: unwrap, check, and LoRA-aware plans.

``parallelize`` takes a ``peft.PeftModel`` and works on the HF model inside it
(``peft_model.base_model.model``), so the adapters' plan paths stay the HF model's. Every LoRA
layer must be a ``lora.Linear`` over an ``nn.Linear`` that a plan shards column- or row-wise
(:mod:`hf_tp.lora.lora_branches` shards its branch like the base); anything else is refused before any
collective, naming the module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from hf_tp.adapters.adapter import Adapter, PlanOptions
from hf_tp.core.module_queries import has_submodule
from hf_tp.dropout.dropout_install import runs_whole
from hf_tp.dropout.tp_dropout import ShardAwareDropout
from hf_tp.lora.lora_branches import is_lora_linear, lora_aware, shards_lora
from hf_tp.moe.expert_lora import is_param_wrapper
from hf_tp.moe.expert_styles import MoERegion
from hf_tp.styles.choice import resolve


def unwrap_peft(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the HF model, whether ``model`` was a peft model). Refuses peft tuners other than LoRA."""
    if not type(model).__module__.startswith("peft."):
        return model, False
    tuner = getattr(model, "base_model", None)
    inner = getattr(tuner, "model", None)
    if type(tuner).__name__ != "LoraModel" or not isinstance(inner, nn.Module):
        raise ValueError(
            f"hf_tp.parallelize takes peft models with LoRA adapters only, got a {type(tuner).__name__}; "
            "create it with peft.get_peft_model(model, peft.LoraConfig(...))"
        )
    return inner, True


def _peft_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module peft put into ``model`` (tuner layers, modules_to_save wrappers...), by path."""
    return {name: m for name, m in model.named_modules() if type(m).__module__.startswith("peft.")}


_WHOLE_RUN = object()  # (the "style" of a module inside a whole-run region)


def _refusal(module: nn.Module, style: ParallelStyle | object | None) -> str | None:
    """Why the LoRA module at ``path`` cannot be sharded, or None."""
    if is_param_wrapper(module):
        return (
            "peft's target_parameters (LoRA on an nn.Parameter) are sharded by hf_tp only on the parameters of a "
            "MoE region (fused experts, router weights) and this one is not one"
        )
    if not is_lora_linear(module) or type(module.base_layer) is not nn.Linear:
        base = type(getattr(module, "base_layer", module)).__name__
        return f"a peft {type(module).__name__} over {base}: hf_tp shards LoRA on nn.Linear projections only"
    if style is None:
        return (
            "it is outside the decoder layers' tp plan (embedding, lm_head, routers, MoE shared experts): "
            "hf_tp shards LoRA on projections the plan splits column- or row-wise or runs whole"
        )
    if style is not _WHOLE_RUN and not shards_lora(style):
        return f"the plan runs it with {type(style).__name__}, which has no LoRA rule"
    if module.lora_variant or any(module.lora_magnitude_vector.keys()):
        return "LoRA variants (DoRA, aLoRA, ...) are not supported under tp; use plain LoRA"
    if module.merged or getattr(module, "fan_in_fan_out", False):
        return "merged adapters or fan_in_fan_out layers are not supported; unmerge, or target nn.Linear"
    return None


def check_lora(model: nn.Module, adapter: Adapter, opts: PlanOptions, tp: int, ep: int = 1) -> list[str]:
    """Refuse (``ValueError`` naming the module) every peft module hf_tp cannot shard at ``tp`` and
    ``ep``. At tp = 1 and ep = 1 nothing is sharded and every peft module runs as in plain peft;
    with ep > 1 the experts are frozen and expert-parallel, LoRA sits on the projections around them.
    On a multimodal wrapper LoRA sits on the language model: its tower and projector run whole.
    Returns the paths of the LoRA layers in blocks that run whole on every tp rank (:func:`install_dropouts`)."""
    for path in _peft_modules(model):
        if adapter.is_passenger(path):
            raise ValueError(
                f"LoRA on {path}: it lies in the {adapter.model_type} wrapper's vision tower or projector, which "
                "hf_tp runs whole and has not verified LoRA on; put LoRA on the language model (peft's "
                "exclude_modules, or hf-tp train's default)"
            )
    whole_run: list[str] = []
    if tp == 1 and ep == 1:
        return whole_run
    plan, prefix = adapter.layer_plan(opts), f"{adapter.layers_path}."
    for path, module in _peft_modules(model).items():
        sub = path[len(prefix) :].partition(".")[2] if path.startswith(prefix) else ""
        style = plan.get(sub)
        if is_param_wrapper(module) and (tp == 1 or _in_moe_region(model, plan, path, prefix, module.parameter_name)):
            continue  # the region or expert parallelism adds its update to the views (hf_tp.moe.expert_lora)
        if style is None and path.startswith(prefix) and _in_whole_block(model, plan, path, prefix):
            style = _WHOLE_RUN  # computed whole on every tp rank, as the region's own weights
        reason = _refusal(module, style) if tp > 1 else None
        if reason is not None:
            where = "target_parameters" if is_param_wrapper(module) else "target_modules"
            raise ValueError(f"LoRA on {path}: {reason}; leave it out of {where}")
        if style is _WHOLE_RUN:
            whole_run.append(path)  # its dropout: the tp group's mask (install_dropouts)
    return whole_run


def _in_whole_block(model: nn.Module, plan: dict, path: str, prefix: str) -> bool:
    """The module at ``path`` sits in a block that runs whole on every tp rank in its own layer
    (a per-layer choice, a mixer's kind or dense-or-MoE, made for that layer's block)."""
    index, _, sub = path[len(prefix) :].partition(".")
    layer = model.get_submodule(prefix + index)
    for block, style in plan.items():
        if sub.startswith(block + ".") and has_submodule(layer, block):
            chosen = resolve(style, layer.get_submodule(block))
            if chosen is not None and runs_whole(chosen):
                return True
    return False


def _in_moe_region(model: nn.Module, plan: dict, path: str, prefix: str, leaf: str) -> bool:
    """peft's ``ParamWrapper`` at ``path`` wraps a parameter (``leaf``) of its layer's MoE region."""
    if not path.startswith(prefix):
        return False
    index, _, sub = path[len(prefix) :].partition(".")
    layer = model.get_submodule(prefix + index)
    name = ".".join(part for part in f"{sub}.{leaf}".split(".") if part != "base_layer")
    for block, style in plan.items():
        if name.startswith(block + ".") and has_submodule(layer, block):
            chosen = resolve(style, layer.get_submodule(block))
            regions = [s for s in getattr(chosen, "styles", (chosen,)) if isinstance(s, MoERegion)]  # (a Compose)
            if any(name[len(block) + 1 :] in region.roles for region in regions):
                return True
    return False


def lora_adapter(adapter: Adapter) -> Adapter:
    """``adapter`` with every column/row-parallel style made LoRA-aware (:func:`lora_aware`)."""

    def wrap(plan_fn):
        return lambda opts: {path: lora_aware(style) for path, style in plan_fn(opts).items()}

    return dataclasses.replace(adapter, layer_plan=wrap(adapter.layer_plan), top_plan=wrap(adapter.top_plan))


def install_dropouts(model: nn.Module, whole_run: list[str], tp: int) -> int:
    """Replace peft's ``nn.Dropout`` in every LoRA layer by :class:`ShardAwareDropout` (same p);
    returns how many. A LoRA layer in a whole-run region (``whole_run``: plain tensors, the same on
    every tp rank) draws the mask of its tp group (ranks ``build_mesh`` puts adjacent)."""
    index = replaced = 0
    whole = set(whole_run)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for path, module in model.named_modules():
        if not is_lora_linear(module):
            continue
        for name, drop in list(module.lora_dropout.items()):
            if isinstance(drop, nn.Dropout):
                owner = rank - rank % tp if path in whole else None
                module.lora_dropout[name] = ShardAwareDropout(drop.p, index, owner=owner)
                replaced += 1
            index += 1
    return replaced


def check_dropout_recompute(model: nn.Module) -> None:
    """Under activation checkpointing: every LoRA dropout keeps its masks' keys for the recompute
    (which torch's checkpoint runs with torch's default generators restored, not these), so the
    recompute redraws the forward's masks."""
    for m in model.modules():
        if isinstance(m, ShardAwareDropout):
            m.checkpointed = True


@contextlib.contextmanager
def keep_frozen(model: nn.Module) -> Iterator[None]:
    """Parameters frozen on entry (a LoRA model's base) are frozen again on exit: some styles
    (torch's ``SequenceParallel``) re-register the parameters they distribute as trainable."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    yield
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def freeze_in_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen floating-point parameter (a LoRA model's base) in ``dtype``, the compute
    dtype: FSDP2's mixed precision would cast it to that for every forward anyway, and a frozen
    weight needs no fp32 master copy (FSDP2 asks for one dtype among trainable parameters only).
    Returns the number of parameters converted. Call it before ``parallelize``."""
    done = 0
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            done += 1
    return done


def lora_init_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) initial LoRA factors of every ``lora.Linear`` in ``model``: peft's default
    init (``lora_A`` Kaiming-uniform with ``a = sqrt(5)``, ``lora_B`` and its bias zero) drawn in
    module order from a generator seeded with ``seed``, so every rank, and a single-process peft
    model given the same state, starts from the same adapters whatever the sharding."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not is_lora_linear(module):
            continue
        for adapter, a in module.lora_A.items():
            w = torch.empty(a.weight.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
            out[f"{name}.lora_A.{adapter}.weight"] = w.to(a.weight.dtype)
            for pname, p in module.lora_B[adapter].named_parameters():
                out[f"{name}.lora_B.{adapter}.{pname}"] = torch.zeros(p.shape, dtype=p.dtype)
    return out
