"""peft's LoRA on a parameter (``target_parameters``: ``ParamWrapper``) inside hf_tp's MoE regions
and expert parallelism.

peft's ``all-linear`` on a MoE model wraps the router's ``weight`` and the fused 3-D expert weights
(``gate_up_proj``, ``down_proj``) in ``ParamWrapper`` modules, which, for each forward, make the
wrapped parameter ``W + scaling * lhs @ rhs`` (its low-rank factors per expert). hf_tp shows the
code of a MoE region or of expert-parallel experts a *view* of each parameter (this rank's tp slice
of its experts, or the whole replicated router), so the wrapper's own parametrization is switched
off (:func:`adopt_param_wrappers`) and the view-makers call :func:`with_lora`: the view plus the
same update, made from the factors' slices that produce this rank's slice of it. The factors stay
whole on every rank (replicated over tp as the router, FSDP2-sharded over dp), so each rank's
factor gradient is its experts' and slices' term of the full gradient: a ``Partial`` sum over tp
(the region's replicated views) and, under expert parallelism, over ep, which FSDP2's average over
dp turns into the global batch's gradient as it does for the expert weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_tp.compat.peft_private import parametrization_off, swapped_in_out, wrapped_ndim
from hf_tp.compat.torch_internals import parameter_slots
from hf_tp.core.record import facts, facts_of


def is_param_wrapper(module: nn.Module) -> bool:
    """True for peft's ``ParamWrapper`` (LoRA on one ``nn.Parameter`` of its base module)."""
    return type(module).__name__ == "ParamWrapper" and type(module).__module__.startswith("peft.")


def peft_base(module: nn.Module) -> nn.Module:
    """The module a (possibly nested) chain of ``ParamWrapper`` modules wraps, or ``module``."""
    while is_param_wrapper(module):
        module = module.base_layer
    return module


def factor_paths(block: nn.Module) -> list[str]:
    """Paths (relative to ``block``) of every LoRA factor of the ``ParamWrapper`` modules under it."""
    out = []
    for path, module in block.named_modules():
        if is_param_wrapper(module):
            pre = f"{path}." if path else ""
            for kind in ("lora_A", "lora_B"):
                out += [f"{pre}{kind}.{n}" for n, _ in getattr(module, kind).named_parameters()]
    return out


def adopt_param_wrappers(block: nn.Module) -> None:
    """Record on each wrapped module which ``ParamWrapper`` adds its update to which parameter,
    and switch the wrappers' own parametrization off (their forward then calls the base as is)."""
    for module in block.modules():
        if is_param_wrapper(module):
            base = peft_base(module)
            facts(base).lora[module.parameter_name] = module
            parametrization_off(module)


def with_lora(owner: nn.Module, leaf: str, view: torch.Tensor) -> torch.Tensor:
    """``view`` (what the code sees for ``owner``'s parameter ``leaf``) plus the LoRA update of
    the ``ParamWrapper`` adopted for it, restricted to the view's experts and tp slice."""
    found = facts_of(owner)
    wrapper = None if found is None else found.lora.get(leaf)
    if wrapper is None or wrapper.disable_adapters or wrapper.merged:
        return view
    for adapter in wrapper.active_adapters:
        if adapter not in wrapper.lora_A:
            continue
        lhs, rhs = _local_factors(owner, leaf, *_factors(wrapper, adapter))
        lhs, rhs, scaling = lhs.to(view.dtype), rhs.to(view.dtype), wrapper.scaling[adapter]
        view = torch.baddbmm(view, lhs, rhs, alpha=scaling) if view.dim() == 3 else view + (lhs @ rhs) * scaling
    return view


def region_role(owner: nn.Module, leaf: str) -> tuple | None:
    """``(Role, tp)`` of ``owner``'s parameter ``leaf`` in a MoE region (:class:`hf_tp.moe.expert_styles.MoERegion`), or None."""
    found = facts_of(owner)
    return None if found is None else found.region_roles.get(leaf)


def _plain(w: torch.Tensor) -> torch.Tensor:
    """A factor outside a region (expert parallelism at tp = 1) as the plain tensor it is."""
    return w.to_local() if isinstance(w, DTensor) else w


def _factors(wrapper: nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lhs, rhs)`` of ``wrapper``'s adapter now (:func:`update_factors`)."""
    return update_factors(wrapper, _plain(wrapper.lora_A[adapter].weight), _plain(wrapper.lora_B[adapter].weight))


def update_factors(wrapper: nn.Module, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lhs, rhs)`` with the update ``scaling * lhs @ rhs`` in the wrapped parameter's layout from
    the factors ``a`` (``lora_A``) and ``b`` (``lora_B``) (peft's ``get_delta_factors``; for a 2-D
    parameter ``lora_B @ lora_A``)."""
    if wrapped_ndim(wrapper) == 2:
        return b, a
    n = wrapper.num_experts
    a = a.reshape(n, -1, a.shape[-1])  # (experts, rank, in)
    b = b.reshape(b.shape[0], -1, n).permute(2, 0, 1)  # (experts, out, rank)
    if swapped_in_out(wrapper):  # stored (experts, out, in)
        return b, a
    return a.transpose(-2, -1), b.transpose(-2, -1)


def _local_factors(owner: nn.Module, leaf: str, lhs: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The factors' slices whose product is this rank's view: its experts (expert parallelism) and
    its tp slice of a sharded dim (dim 1 is ``lhs``'s rows, dim 2 ``rhs``'s columns; packed halves
    sliced each)."""
    shard = getattr(facts_of(owner), "experts", None)
    if shard is not None and lhs.dim() == 3:
        start, n = shard.start, shard.local
        lhs, rhs = lhs[start : start + n], rhs[start : start + n]
    found = region_role(owner, leaf)
    if found is None or found[0].kind != "shard" or found[1] == 1:
        return lhs, rhs
    role, tp = found
    mesh = parameter_slots(owner)[leaf].device_mesh
    rank = mesh.get_local_rank(mesh.ndim - 1)  # tp: the last mesh dim
    if role.dim not in (1, 2) or lhs.dim() != 3:
        raise ValueError(f"LoRA on {type(owner).__name__}.{leaf}: hf_tp slices expert factors on dims 1 and 2 only")
    t = lhs if role.dim == 1 else rhs
    halves = t.unflatten(role.dim, (2, -1)) if role.packed else t.unsqueeze(role.dim)
    size = halves.shape[role.dim + 1] // tp
    mine = halves.narrow(role.dim + 1, rank * size, size).flatten(role.dim, role.dim + 1)
    return (mine, rhs) if role.dim == 1 else (lhs, mine)
