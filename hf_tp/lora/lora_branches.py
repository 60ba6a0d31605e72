"""LoRA branches sharded like their base projection (peft's ``lora.Linear``).

peft wraps a target ``nn.Linear`` in a ``lora.Linear``: ``base_layer(x) + lora_B(lora_A(dropout(x)))
* scaling``. A style that shards a projection shards its branch the same way, with the input and
output hooks on the wrapper so that the branch sees what the base sees:

- column-parallel base (``weight`` ``Shard(0)``): ``lora_A`` replicated (it reads the whole input:
  the gathered sequence), ``lora_B`` ``Shard(0)`` like the base; the branch output is sharded on
  features as the base's;
- row-parallel base (``weight`` ``Shard(1)``): ``lora_A`` ``Shard(1)`` (it reads the rank's input
  features), ``lora_B`` replicated; the branch output is a partial sum added to the base's partial
  sum before the one reduction (reduce-scatter under sequence parallelism).

So a LoRA layer makes exactly the collectives of its base. The replicated factor's gradient is
``Partial`` over tp (``lora_A`` of a column base: its input gradient is a partial sum; ``lora_B``
of a row base: its input is one) and joins the fused all-reduce of
:mod:`hf_tp.parallel.partial_grads`. :func:`lora_aware` gives any ``ColwiseParallel`` or
``RowwiseParallel`` (subclasses included) this behaviour; it is unchanged on other modules.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from hf_tp.compat.torch_internals import copy_instance
from hf_tp.compat.torch_styles import linear_style_hooks
from hf_tp.core.record import reclass
from hf_tp.moe.expert_styles import DenseOrMoE
from hf_tp.styles.choice import ByKind
from hf_tp.styles.heads import Compose, LocalParamViews
from hf_tp.styles.kv_heads import KVHeadLinear, ReplicatedKVProjection


def is_lora_linear(module: nn.Module) -> bool:
    """True for peft's ``lora.Linear`` (checked by shape, so peft stays optional)."""
    return (
        type(module).__module__.startswith("peft.")
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "base_layer", None), nn.Module)
    )


class _LoraBranch:
    """Mixin for ``ColwiseParallel``/``RowwiseParallel``: shard a ``lora.Linear`` like its base."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_lora_linear(module):
            return super()._apply(module, device_mesh)
        row = isinstance(self, RowwiseParallel)
        if row:
            self.desired_input_layouts = (Shard(-1),)  # as RowwiseParallel sets it for a Linear
        split = [module.base_layer, *(module.lora_A.values() if row else module.lora_B.values())]

        partition_linear, prepare_input, prepare_output = linear_style_hooks(self)

        def partition(name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
            if any(sub is s for s in split):  # the rest (the other factor) is replicated
                partition_linear(name, sub, mesh)

        return distribute_module(
            module,
            device_mesh,
            partition,
            partial(prepare_input, self.input_layouts, self.desired_input_layouts),
            partial(prepare_output, self.output_layouts, self.use_local_output),
        )


_CLASSES: dict[type, type] = {}


def lora_aware(style: ParallelStyle) -> ParallelStyle:
    """A copy of ``style`` that also shards peft ``lora.Linear`` modules (module docstring), or
    ``style`` itself when it is not a column/row-parallel or KV-replicated linear style."""
    base = type(style)
    if issubclass(base, (_LoraBranch, _LoraKVHeads, _LoraWholeRun)):
        return style
    if isinstance(style, Compose):
        return Compose(*(lora_aware(s) for s in style.styles))
    if isinstance(style, ByKind):  # each kind of a per-layer mixer as it would be alone
        return ByKind({kind: None if s is None else lora_aware(s) for kind, s in style.styles.items()})
    if isinstance(style, DenseOrMoE) and style.dense is not None:  # its dense layers' style (the region as is)
        return DenseOrMoE(lora_aware(style.dense), style.moe, style.experts)
    if issubclass(base, LocalParamViews):
        mixin = _LoraWholeRun
    elif issubclass(base, ReplicatedKVProjection):
        mixin = _LoraKVHeads
    elif issubclass(base, (ColwiseParallel, RowwiseParallel)):
        mixin = _LoraBranch
    else:
        return style
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Lora{base.__name__}", (mixin, base), {"__module__": __name__})
    return copy_instance(style, _CLASSES[base])


class _LoraWholeRun:
    """Mixin for :class:`~hf_tp.styles.heads.LocalParamViews`: a region's weight ``p.weight``
    whose module ``p`` is a ``lora.Linear`` stands for its base weight and both factors, so they
    are distributed and viewed alike (whole on every rank with ``Replicate``: the LoRA branch is
    computed whole, as the region)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names, modules = [], dict(module.named_modules())
        for name in self.names:
            prefix, _, leaf = name.rpartition(".")
            owner = modules.get(prefix) if prefix else None
            if owner is None or not is_lora_linear(owner):
                names.append(name)
                continue
            names.append(f"{prefix}.base_layer.{leaf}")
            if leaf == "weight":
                names += [f"{prefix}.{kind}.{n}" for kind in ("lora_A", "lora_B") for n, _ in _params(owner, kind)]
        out = copy.copy(self)
        out.names = tuple(names)
        return super(_LoraWholeRun, out)._apply(module, device_mesh)


def _params(owner: nn.Module, kind: str) -> list[tuple[str, nn.Parameter]]:
    return list(getattr(owner, kind).named_parameters())


def shards_lora(style: ParallelStyle) -> bool:
    """Whether :func:`lora_aware` gives ``style`` a LoRA rule."""
    return isinstance(style, (ColwiseParallel, RowwiseParallel, ReplicatedKVProjection))


class _LoraKVHeads:
    """Mixin for :class:`~hf_tp.styles.kv_heads.ReplicatedKVProjection`: the base and both factors
    whole on every rank; ``lora_A`` computed whole, ``lora_B`` only on this rank's KV-head rows,
    as the base. Every weight gradient is one rank's term of a sum over tp (``Partial``, fused), and
    the input's gradient too (reduce-scattered with the query projection's under SP)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_lora_linear(module):
            return super()._apply(module, device_mesh)
        base = super()._apply(module.base_layer, device_mesh)
        for sub in (*module.lora_A.values(), *module.lora_B.values()):
            distribute_module(sub, device_mesh)  # replicated
        for a in module.lora_A.values():
            reclass(a, WholeLinearPartialGrads)
        for b in module.lora_B.values():
            reclass(b, KVHeadRowsOfLocalInput)
            b.head_start, b.head_dim = base.head_start, base.head_dim
        module.register_forward_pre_hook(_replicated_input)  # one input for base, dropout and branch
        return module


def _replicated_input(module: nn.Module, args: tuple) -> tuple:
    """Without sequence parallelism the input is a plain tensor, whole on every rank: make it a
    ``Replicate`` DTensor, so the dropout draws the tp group's mask and the base and the branch
    add their input gradients before the one all-reduce."""
    x, *rest = args
    if isinstance(x, DTensor):
        return args
    mesh = module.base_layer.weight.device_mesh
    return (DTensor.from_local(x, mesh, [Replicate()], run_check=False), *rest)


class WholeLinearPartialGrads(nn.Linear):
    """``lora_A`` of a KV-replicated projection: the whole product on every rank from a replicated
    weight and input, both handed to autograd as ``Partial`` (this rank's gradient term)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not all(p.is_replicate() for p in x.placements):
            x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
        local = x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim)
        return F.linear(local, self.weight.to_local(grad_placements=[Partial()]))


class KVHeadRowsOfLocalInput(KVHeadLinear):
    """``lora_B`` of a KV-replicated projection: this rank's KV-head rows of a replicated weight
    applied to a local input (``lora_A``'s output), no collective."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows = slice(self.head_start, self.head_start + self.head_dim)
        bias = self.bias.to_local(grad_placements=[Partial()])[rows] if self.bias is not None else None
        return F.linear(h, self.weight.to_local(grad_placements=[Partial()])[rows], bias)
