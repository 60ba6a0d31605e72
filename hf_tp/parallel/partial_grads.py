"""Sum every tp-``Partial`` weight gradient of a backward pass in one all-reduce.

Weights replicated over tp but applied to sharded activations (the sequence-parallel norms on
sequence shards, Qwen3's per-head q/k norms on the rank's heads) get ``Partial(sum)`` gradients
from DTensor. Left alone, each is all-reduced on its own: FSDP2 redistributes each one to
``Replicate`` in its post-backward (2L+1 small all-reduces per backward for a Llama, 4L+1 for a
Qwen3), and without FSDP2 AdamW's DTensor ops would all-reduce each one three times per step.
Megatron-LM sums all such gradients in one bucket; torch and FSDP2 offer no hook for it, so
this module does it:

- a tensor hook on the tensor autograd accumulates into (the parameter, or FSDP2's unsharded
  parameter) keeps each ``Partial`` gradient and hands autograd a zero ``Replicate`` one instead,
  which FSDP2 then reduces as it would any replicated gradient (no extra collective);
- autograd's final callback of the same backward, which runs after FSDP2's, flattens the kept
  gradients into one buffer, all-reduces it once (over tp, and over dp where FSDP2 shards the
  weight: it would have averaged them over dp in its reduce-scatter), and adds each slice to the
  gradient the optimizer reads (FSDP2's sharded one: this rank's dp chunk).

A weight whose hook is missing (parameters replaced after the first forward) just keeps the
default per-weight reduction: correct either way. ``torch.autograd.grad`` on these weights
returns the zero placeholder; use ``backward()``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from hf_tp.compat.torch_internals import eager_only, parameter_slots, queue_backward_callback


@dataclass
class _Weight:
    module: nn.Module
    name: str
    hooked: list[torch.Tensor] = field(default_factory=list)  # tensors that carry our hook


class PartialGradReducer:
    """The hooks and the per-backward flush for the replicated weights of one model."""

    def __init__(self, groups: list[dist.ProcessGroup], dp_divisor: int, fsdp: bool) -> None:
        self.fsdp = fsdp
        self.groups = groups  # all-reduced in order; one group (the world) when it spans dp and tp
        self.dp_divisor = dp_divisor  # FSDP2 averages gradients over dp; so do we
        self._pending: list[tuple[_Weight, torch.Tensor]] = []
        self._queued = False
        self.flushes = 0  # backward passes that reduced something (the parity tests check it)
        self.outside: set[int] = set()  # ids of parameters outside FSDP2 (whole on every dp rank)

    def hook_current_tensors(self, weights: list[_Weight]) -> None:
        """Hook the tensors the modules hold right now: FSDP2's unsharded parameters while it
        has them unsharded, else the parameters themselves."""
        for w in weights:
            t = parameter_slots(w.module)[w.name]
            if t is not None and t.requires_grad and not any(h is t for h in w.hooked):  # (frozen: no gradient)
                t.register_hook(self._hook(w))
                w.hooked.append(t)

    def _hook(self, weight: _Weight):
        def keep_partial(grad: torch.Tensor) -> torch.Tensor:
            if not isinstance(grad, DTensor) or not any(p.is_partial() for p in grad.placements):
                return grad
            if any(p.is_partial() and p.reduce_op != "sum" for p in grad.placements):
                return grad
            local = grad.to_local()
            self._pending.append((weight, local))
            if not self._queued:
                queue_backward_callback(self._flush)
                self._queued = True
            placements = [Replicate() if p.is_partial() else p for p in grad.placements]
            zero = torch.zeros_like(local)
            return DTensor.from_local(zero, grad.device_mesh, placements, shape=grad.shape, stride=grad.stride())

        return keep_partial

    @torch.no_grad()
    def _flush(self) -> None:
        pending, self._pending, self._queued = self._pending, [], False
        if not pending:
            return
        # summed in fp32 at least (bf16 gradients upcast), never below the gradients' own dtype (float64 stays)
        dtype = functools.reduce(torch.promote_types, (g.dtype for _, g in pending), torch.float32)
        flat = torch.cat([g.reshape(-1).to(dtype) for _, g in pending])
        for group in self.groups:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if self.dp_divisor != 1:
            flat.div_(self.dp_divisor)
        offset = 0
        for weight, g in pending:
            full = flat[offset : offset + g.numel()].view(g.shape)
            offset += g.numel()
            # After backward FSDP2 has put its sharded parameter (the optimizer's) back in place.
            param = parameter_slots(weight.module)[weight.name]
            if self.fsdp and id(param) not in self.outside and any(param is h for h in weight.hooked):
                raise RuntimeError(
                    f"hf_tp: FSDP2 left {weight.name} unsharded after backward, so its fused gradient has "
                    "nowhere to go; keep reshard_after_backward on, or pass fuse_partial_grads=False to parallelize"
                )
            _add_grad(param, full)
        self.flushes += 1


def _add_grad(param: torch.Tensor, full: torch.Tensor) -> None:
    """Add the whole (unsharded) gradient ``full`` to ``param.grad``, taking this rank's chunk."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        inc = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        inc = inc.redistribute(mesh, param.placements)  # Replicate -> Shard: a local chunk, no collective
    else:
        inc = full
    inc = inc.to(param.dtype)
    if param.grad is None:
        param.grad = inc
    else:
        param.grad.add_(inc)


def replicated_weights(model: nn.Module) -> list[_Weight]:
    """The trainable DTensor parameters replicated on every mesh dim (after TP, before FSDP2)."""
    out, seen = [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad or not isinstance(p, DTensor):
                continue
            if all(pl.is_replicate() for pl in p.placements):
                seen.add(id(p))
                out.append(_Weight(module, name))
    return out


def install(
    model: nn.Module,
    units: list[nn.Module],
    tp_mesh: DeviceMesh,
    dp_mesh: DeviceMesh | None,
    fsdp: bool,
    outside: set[nn.Parameter] | None = None,
) -> PartialGradReducer | None:
    """Set up the fused reduction on a tensor-parallel ``model``, after TP and before FSDP2.

    ``units`` are the modules FSDP2 will shard on their own (the decoder layers; the root
    ``model`` holds the rest). Without FSDP2 pass ``[]``. ``outside``: parameters FSDP2 will
    leave whole on every dp rank (their reduced gradient goes to the parameter itself).
    """
    weights = replicated_weights(model)
    if not weights:
        return None
    groups = [tp_mesh.get_group()]
    dp = dp_mesh.size() if fsdp and dp_mesh is not None else 1
    if dp > 1:
        if tp_mesh.size() * dp == dist.get_world_size():
            groups = [dist.group.WORLD]  # one collective over dp and tp together
        else:
            groups.append(dp_mesh.get_group())
    reducer = PartialGradReducer(groups, dp, fsdp)
    reducer.outside = {id(p) for p in outside or ()}

    # The tensors to hook exist only at forward time: FSDP2 creates a unit's unsharded parameters
    # at its first all-gather (and swaps them in in its pre-forward, which runs before any other
    # pre-hook), and a meta-built model is materialised after parallelize. So each unit hooks its
    # own weights in its first forward, then drops the pre-hook.
    rest = list(weights)
    for unit in units:
        inside = {id(m) for m in unit.modules()}
        _hook_at_first_forward(unit, reducer, [w for w in rest if id(w.module) in inside])
        rest = [w for w in rest if id(w.module) not in inside]
    _hook_at_first_forward(model, reducer, rest)
    return reducer


def _hook_at_first_forward(unit: nn.Module, reducer: PartialGradReducer, weights: list[_Weight]) -> None:
    if not weights:
        return

    @eager_only  # runs once, eagerly, also in front of a compiled decoder layer
    def first_forward(module: nn.Module, args) -> None:
        handle.remove()
        reducer.hook_current_tensors(weights)

    handle = unit.register_forward_pre_hook(first_forward)
