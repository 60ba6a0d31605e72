"""The mixture-of-experts block as one tensor-parallel region (expert tensor parallelism).

A MoE block (router, experts stored as fused 3-D parameters, optional shared experts) is run the
way Megatron runs an MLP under sequence parallelism: its input is all-gathered from the sequence
shards once, everything inside runs on plain local tensors over the whole sequence, and its
output, a sum of per-rank partial results, is reduce-scattered back to sequence shards once. The
layer stays at the SP minimum of collectives, whatever the block's code does with its tensors
(top-k, one-hot masks, ``index_add_``, grouped matmuls: code DTensor could not follow op by op).

Each parameter of the block has a :class:`Role`:

- ``shard``: the rank keeps a slice along ``dim`` (an expert's intermediate rows or columns, a
  shared expert's column- or row-parallel weight); ``packed`` parameters hold two halves along
  ``dim`` (gate and up) and each rank keeps the matching slice of both, stored as a
  ``[..., 2, n/2, ...]`` DTensor so a plain ``Shard`` describes it (checkpoints reshard with DCP;
  export and loading reshape it to the HF layout, :func:`hf_layout_shape`);
- ``replicate``: the whole tensor on every rank (the router, a shared expert's gate): it only
  scales or selects the partial results, so each rank's gradient is a partial sum (``Partial``,
  reduced with the other replicated weights in :mod:`hf_tp.parallel.partial_grads`);
- ``additive``: a replicated term added once to the output (a row-parallel bias): each rank adds
  ``1/tp`` of it, so the reduce-scatter adds it exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hf_tp.compat.torch_internals import own_attribute, parameter_slots, pop_own_attribute, set_own_attribute
from hf_tp.core.record import facts, facts_of
from hf_tp.moe.expert_lora import adopt_param_wrappers, factor_paths, peft_base, region_role, with_lora
from hf_tp.styles.choice import PerLayerChoice, resolve


@dataclass(frozen=True)
class Role:
    """How one parameter of a MoE region is placed over tp (see the module docstring)."""

    kind: str  # "shard" | "replicate" | "additive"
    dim: int = 0
    packed: bool = False


def stored_shape(shape: tuple[int, ...], role: Role) -> tuple[int, ...]:
    """The shape hf_tp stores a parameter with: packed halves get their own dim of size 2."""
    if role.kind != "shard" or not role.packed:
        return tuple(shape)
    return (*shape[: role.dim], 2, shape[role.dim] // 2, *shape[role.dim + 1 :])


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` (the router logits' path to the aux loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class MoERegion(ParallelStyle):
    """Run a MoE block on local tensors: gathered input, per-role parameter views, partial output
    reduce-scattered to sequence shards (all-reduced when ``sequence_parallel`` is off).

    ``roles`` maps every parameter under the block (dotted names relative to it) to its
    :class:`Role`; ``positional`` says how the decoder layer passes the hidden states (0: by the
    keyword ``hidden_states``, else the number of positional arguments, hidden states first; -1: as
    each call passes them, by that keyword or else first).
    ``output_norm`` names a norm the block applies to its combined output (A.X-K1's
    ``post_mlp_layernorm``): a norm of a partial sum is not the norm of the sum, so the region
    ends at that norm's input (the same one reduce-scatter, earlier) and the norm runs on sequence
    shards under the plan's own style for it (``SequenceParallel``), its parameters outside ``roles``.
    """

    def __init__(
        self,
        roles: dict[str, Role],
        positional: int,
        routers: tuple[str, ...] = (),
        sequence_parallel: bool = True,
        output_norm: str = "",
    ) -> None:
        super().__init__()
        self.roles = roles
        self.positional = positional
        self.routers = routers
        self.sequence_parallel = sequence_parallel
        self.output_norm = output_norm

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        owners = []  # (owner module, leaf name, role)
        for name, role in _with_lora_factors(self.roles, module).items():
            owner, leaf = _owner(module, name)
            param = parameter_slots(owner)[leaf]
            if role.kind == "shard":
                if role.packed:
                    facts(owner).hf_shapes[leaf] = tuple(param.shape)
                value = param.detach().view(stored_shape(tuple(param.shape), role))
                dt = distribute_tensor(value, device_mesh, [Shard(role.dim + role.packed)])
            else:
                dt = distribute_tensor(param, device_mesh, [Replicate()])
            owner.register_parameter(leaf, nn.Parameter(dt, param.requires_grad))
            facts(owner).region_roles[leaf] = (role, tp)
            owners.append((owner, leaf, role))
        seq_layout = Shard(1) if self.sequence_parallel else Replicate()
        layout = [(seq_layout,)]  # the hidden states' token layout at entry, restored at exit
        shape: list[torch.Size] = []  # the gathered hidden states' shape, [batch, sequence, hidden]

        def to_region(x):
            """The block's input, whole on every rank; its gradient is a partial sum."""
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [seq_layout], run_check=False)
            return x.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])

        def enter(mod: nn.Module, args, kwargs):
            for owner, leaf, role in owners:  # an instance attribute shadows the parameter for the call
                set_own_attribute(owner, leaf, _view(parameter_slots(owner)[leaf], role, tp))
            _add_lora_updates(owners)
            by_keyword = self.positional == 0 or (self.positional < 0 and "hidden_states" in kwargs)
            hidden = kwargs["hidden_states"] if by_keyword else args[0]
            # experts a layer calls itself (Gemma 4) take its flattened tokens, in their own layout
            layout[0] = hidden.placements if isinstance(hidden, DTensor) else (seq_layout,)
            whole = to_region(hidden)
            shape[:] = [whole.shape]
            if by_keyword:
                return args, {**kwargs, "hidden_states": whole}
            # further token-sharded arguments (such experts' routing weights and indices) gathered too
            rest = (to_region(a) if isinstance(a, DTensor) else a for a in args[1:])
            return (whole, *rest), kwargs

        def from_region(partial: torch.Tensor) -> torch.Tensor:
            """Per-rank partial results summed: reduce-scattered to sequence shards (all-reduced, local, without SP).
            An output with the tokens flattened (Llama 4's ``[batch * sequence, hidden]``) is summed in
            the input's shape: Shard(1) of the flat one would split the hidden dim, and the layer's
            ``view`` back would cost another all-gather."""
            if partial.dim() != len(shape[0]) and partial.numel() == shape[0].numel():
                partial = partial.reshape(shape[0])
            out = DTensor.from_local(partial, device_mesh, [Partial()], run_check=False)
            out = out.redistribute(device_mesh, layout[0])  # the hidden states' layout at entry
            return out if self.sequence_parallel else out.to_local()

        def leave(mod: nn.Module, args, kwargs, output):
            for owner, leaf, _ in owners:
                pop_own_attribute(owner, leaf)
            if self.output_norm:  # already summed at the norm's input
                return output
            first = output[0] if isinstance(output, tuple) else output
            out = from_region(first)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True)
        if self.output_norm:  # ahead of the norm's own style's input hook
            norm = module.get_submodule(self.output_norm)
            norm.register_forward_pre_hook(lambda mod, args: (from_region(args[0]), *args[1:]), prepend=True)
        for path in self.routers:
            _scale_aux_grad(peft_base(module.get_submodule(path)), 1.0 / tp)  # (where HF records its logits)
        return module


def _owner(block: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the module holding the region parameter ``name`` of ``block``, its leaf name), through
    peft's ``ParamWrapper`` modules to the module they wrap."""
    prefix, _, leaf = name.rpartition(".")
    return peft_base(block.get_submodule(prefix) if prefix else block), leaf


def _add_lora_updates(owners: list[tuple[nn.Module, str, Role]]) -> None:
    """The views made, the LoRA updates of peft's ``ParamWrapper`` modules added to theirs (from the
    factors' views; expert parallelism makes its experts' views, and adds them, itself)."""
    for owner, leaf, _ in owners:
        if getattr(facts_of(owner), "experts", None) is None:
            set_own_attribute(owner, leaf, with_lora(owner, leaf, own_attribute(owner, leaf)))


def _with_lora_factors(roles: dict[str, Role], block: nn.Module) -> dict[str, Role]:
    """``roles`` plus the LoRA factors of peft's ``ParamWrapper`` modules in ``block``, replicated
    (:mod:`hf_tp.moe.expert_lora`), whose wrappers are adopted."""
    factors = factor_paths(block)
    adopt_param_wrappers(block)
    return {**roles, **{path: Role("replicate") for path in factors}}


def hf_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> its shape in HF's layout, for the parameters hf_tp stores in another
    shape (packed expert halves); the same numbers in the same order, so ``reshape`` converts."""
    out = {}
    for prefix, module in model.named_modules():
        for leaf, shape in getattr(facts_of(module), "hf_shapes", {}).items():
            out[f"{prefix}.{leaf}" if prefix else leaf] = shape
    return out


def region_view(owner: nn.Module, leaf: str) -> torch.Tensor | None:
    """What a MoE region's code sees for ``owner``'s parameter ``leaf`` (None outside a region),
    made now from the parameter registered now: for code that must make it later than the region's
    entry (experts sharded over dp by FSDP2 are unsharded at their own forward)."""
    found = region_role(owner, leaf)
    return None if found is None else with_lora(owner, leaf, _view(parameter_slots(owner)[leaf], *found))


def _view(param: DTensor, role: Role, tp: int) -> torch.Tensor:
    """What the block's code sees for ``param``: its local slice in the HF shape, or the whole
    replicated tensor whose gradient is marked a partial sum."""
    if role.kind == "shard":
        local = param.to_local()
        return local.flatten(role.dim, role.dim + 1) if role.packed else local
    # Partial on the tp dim, the last one (expert parallelism puts expert weights on a
    # (dp_out, ep, tp) mesh: their other placements stay as they are)
    local = param.to_local(grad_placements=[*param.placements[:-1], Partial()])
    return local / tp if role.kind == "additive" else local


def _scale_aux_grad(router: nn.Module, scale: float) -> None:
    """On a router that returns ``(logits, ...)``: the logits it hands out (which HF's and hf_tp's
    aux losses read; the routing uses the other outputs) pass their gradient on times ``1/tp``.
    Every tp rank computes the same aux loss from the same logits, while the router's weight
    gradient is summed over tp as a partial sum: without the factor it would count tp times."""

    def scaled(mod: nn.Module, args, output):
        if isinstance(output, tuple) and torch.is_tensor(output[0]) and output[0].requires_grad:
            return (_ScaleGrad.apply(output[0], scale), *output[1:])
        return output

    router.register_forward_hook(scaled)


class DenseOrMoE(PerLayerChoice):
    """One plan entry for a block that is a dense MLP in some layers and a MoE block in others
    (DeepSeek's first dense layers, Qwen's ``mlp_only_layers``): the MoE style where the block has
    its experts module, the dense one elsewhere."""

    def __init__(self, dense: ParallelStyle | None, moe: MoERegion, experts: str) -> None:
        super().__init__()
        self.dense, self.moe, self.experts = dense, moe, experts

    def select(self, module: nn.Module) -> ParallelStyle | None:
        try:
            module.get_submodule(self.experts)
        except AttributeError:
            return self.dense
        return self.moe


def mark_packed(style: ParallelStyle, module: nn.Module) -> None:
    """Record on their owners which parameters of ``module`` the MoE ``style`` stores as packed
    halves under tp > 1: ``packed[leaf] = (dim, HF shape)`` of their :class:`hf_tp.core.record.ModuleFacts`, read before the style is applied
    and at every tp (tp = 1 applies no style), so checkpoints hold one layout on every mesh
    (:mod:`hf_tp.checkpoint.packed`)."""
    style = resolve(style, module)  # a per-layer choice (dense or MoE, by kind): this layer's style
    for inner in getattr(style, "styles", ()):  # a Compose
        mark_packed(inner, module)
    if not isinstance(style, MoERegion):
        return
    for name, role in style.roles.items():
        if role.kind == "shard" and role.packed:
            owner, leaf = _owner(module, name)
            facts(owner).packed[leaf] = (role.dim, tuple(parameter_slots(owner)[leaf].shape))


def packed_params(model: nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Parameter name -> (the dim holding two halves, its HF shape) for every parameter that
    :func:`mark_packed` recorded, whatever the tp of the mesh."""
    out = {}
    for prefix, module in model.named_modules():
        for leaf, found in getattr(facts_of(module), "packed", {}).items():
            out[f"{prefix}.{leaf}" if prefix else leaf] = found
    return out
