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

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


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

        def partition(name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
            if any(sub is s for s in split):  # the rest (the other factor) is replicated
                self._partition_linear_fn(name, sub, mesh)

        return distribute_module(
            module,
            device_mesh,
            partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


_CLASSES: dict[type, type] = {}


def lora_aware(style: ParallelStyle) -> ParallelStyle:
    """A copy of ``style`` that also shards peft ``lora.Linear`` modules (module docstring), or
    ``style`` itself when it is not a column/row-parallel linear style."""
    base = type(style)
    if not issubclass(base, (ColwiseParallel, RowwiseParallel)) or issubclass(base, _LoraBranch):
        return style
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Lora{base.__name__}", (_LoraBranch, base), {"__module__": __name__})
    out = _CLASSES[base].__new__(_CLASSES[base])
    out.__dict__.update(copy.copy(style.__dict__))
    return out


def shards_lora(style: ParallelStyle) -> bool:
    """Whether :func:`lora_aware` gives ``style`` a LoRA rule (column/row-parallel linears)."""
    return isinstance(style, (ColwiseParallel, RowwiseParallel))
