"""Styles for a module's own parameters (attention sinks, a replicated block's) and for blocks that run whole."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hf_tp.compat.torch_internals import parameter_slots, pop_own_attribute, set_own_attribute


class LocalParamViews(ParallelStyle):
    """Distribute the parameters ``names`` of the module (dotted names reach into its submodules)
    over tp with ``placement`` and let its forward see plain local tensors: each is shadowed for the call by ``param.to_local()``, a view
    whose gradient flows back into the DTensor parameter. For code that mixes its parameters with
    plain tensors: attention sinks indexed by the local heads (``Shard(0)``), or the parameters of a
    block that runs whole on every rank (``Replicate()``: every rank computes the same gradient)."""

    def __init__(self, names: tuple[str, ...], placement: Placement) -> None:
        super().__init__()
        self.names = names
        self.placement = placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        owners = []  # (submodule, parameter name): dotted names reach into submodules
        for name in self.names:
            prefix, _, leaf = name.rpartition(".")
            try:
                owner = module.get_submodule(prefix) if prefix else module
            except AttributeError:
                owner = None
            param = parameter_slots(owner).get(leaf) if owner is not None else None
            if param is None:  # a name of another layer kind (hybrid models merge their kinds' names)
                continue
            owner.register_parameter(
                leaf, nn.Parameter(distribute_tensor(param, device_mesh, [self.placement]), param.requires_grad)
            )
            owners.append((owner, leaf))

        def local_views(mod: nn.Module, args) -> None:
            for owner, leaf in owners:  # an instance attribute shadows the registered parameter for the call
                set_own_attribute(owner, leaf, parameter_slots(owner)[leaf].to_local())

        def drop_views(mod: nn.Module, args, output):
            for owner, leaf in owners:
                pop_own_attribute(owner, leaf)
            return output

        module.register_forward_pre_hook(local_views)
        module.register_forward_hook(drop_views)
        return module


def LocalHeadParams(names: tuple[str, ...]) -> LocalParamViews:  # noqa: N802 - a style, named like one
    """Per-head parameters of an attention module (sinks), sharded with the heads."""
    return LocalParamViews(names, Shard(0))


class ReplicatedToSequenceShards(ParallelStyle):
    """The output of a block that ran whole on every rank (a plain tensor, the same everywhere)
    handed back to the residual stream as its sequence shard (a ``Shard(1)`` DTensor): a local
    slice, no communication; in backward the shards' gradients are all-gathered into it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_shards(mod: nn.Module, args, output):
            first = output[0] if isinstance(output, tuple) else output
            if isinstance(first, DTensor):
                return output
            shards = DTensor.from_local(first, device_mesh, [Replicate()], run_check=False).redistribute(
                device_mesh, [Shard(1)]
            )
            return (shards, *output[1:]) if isinstance(output, tuple) else shards

        module.register_forward_hook(to_shards)
        return module


class PositionsToSequenceShards(ReplicatedToSequenceShards):
    """A position embedding outside the layers that computes its own positions (OPT's learned one,
    XGLM's sinusoids): run whole on every rank, its output handed on as the rank's sequence shard."""


class Compose(ParallelStyle):
    """Several styles on one module, applied in order (a plan has one entry per module path)."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


class LocalHeadCounts(ParallelStyle):
    """Point an attention module's own head counts at the rank's heads: each integer attribute in
    ``names`` (``num_heads``, ``num_key_value_heads``, ``embed_dim`` = heads x head_dim...) becomes
    its value / tp, or 1 where tp is a multiple of it (a KV head replicated on tp / kv ranks).
    For attention code that reshapes with ``self.num_heads`` rather than ``-1``: with its
    projections column-parallel it holds the local heads' columns only."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        for name in self.names:
            value = getattr(module, name)
            if value % tp and tp % value:
                raise ValueError(
                    f"tp ({tp}) neither divides nor is a multiple of {type(module).__name__}.{name} ({value}): "
                    "use a tp that divides the head counts"
                )
            setattr(module, name, value // tp if value % tp == 0 else 1)
        return module
