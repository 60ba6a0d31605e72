"""Counting the work of one rank's training step: matmul and attention FLOPs, and the bytes that
the other (memory-bound) kernels read and write, from the local ops that reach dispatch.

Like :class:`hf_tp.estimate.comm.CommCounter`, a ``TorchDispatchMode`` that lets DTensor lower
to local ops first, so every count is this rank's share. FLOPs use torch's own formulas
(``torch.utils.flop_counter``); the attention kernel CPU fake tensors dispatch to (the flash
kernel ``_scaled_dot_product_flash_attention_for_cpu``) gets torch's sdpa formulas. Ops run while
autograd recomputes a checkpointed layer in backward are counted apart, so the model FLOPs of the
step (without recompute) are known too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Kernels that move no data of their own (allocation, aliasing) or are bookkeeping.
_NO_TRAFFIC = {
    "empty",
    "empty_like",
    "empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "set_",
    "resize_",
    "_local_scalar_dense",
    "_unsafe_view",
}
_COUNTED_NAMESPACES = {"aten", "fsdp"}  # collectives (c10d, _c10d_functional) are timed by the comm model


@dataclass
class Work:
    """One rank's work in one training step.

    ``matmul_flops``/``attention_flops`` include any recompute; ``recompute_flops`` is the part
    of both run again by activation checkpointing. ``memory_bytes`` is read + written by every
    other kernel (norms, activations, casts, FSDP's copies, AdamW), as eager PyTorch runs them.
    Attention FLOPs count the full ``S x S`` score matrix (torch's formula, the convention of
    published MFU figures); a causal kernel does about half of them.
    """

    matmul_flops: int = 0
    attention_flops: int = 0
    recompute_flops: int = 0
    memory_bytes: int = 0
    memory_kernels: int = 0
    causal: bool = True
    by_op: dict[str, int] = field(default_factory=dict)

    @property
    def model_flops(self) -> int:
        """FLOPs of the step without recompute (the numerator of MFU)."""
        return self.matmul_flops + self.attention_flops - self.recompute_flops

    def to_dict(self) -> dict:
        return {**asdict(self), "model_flops": self.model_flops}


def _bytes(obj) -> int:
    leaves, _ = tree_flatten(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _shape(x):
    return x.shape if isinstance(x, torch.Tensor) else x


def _cpu_flash_forward(query, key, value, *args, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _grouped_mm(a, b, *args, out=None, **kwargs) -> int:
    """``_grouped_mm``: each row of the ragged operand meets one group's matrix."""
    if a.dim() == 2 and b.dim() == 2:  # (K, T) x (T, N) -> (G, K, N): the weight gradient
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out.numel() * a.shape[-1]


_ATTENTION_EXTRA = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_flash_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_flash_backward,
}


def flops_of(func, args, kwargs, out) -> tuple[str, int] | None:
    """``("matmul" | "attention", flops)`` of one local op, or None for an op without a formula."""
    if func in _ATTENTION_EXTRA:
        return "attention", int(_ATTENTION_EXTRA[func](*args, **kwargs))
    packet = func.overloadpacket
    if packet is aten._grouped_mm:
        return "matmul", int(_grouped_mm(*args, out=out, **kwargs))
    formula = flop_counter.flop_registry.get(packet)
    if formula is None:
        return None
    kind = "attention" if "attention" in packet.__name__ else "matmul"
    shapes_args = [_shape(a) for a in args]
    shapes_kwargs = {k: _shape(v) for k, v in kwargs.items()}
    return kind, int(formula(*shapes_args, **shapes_kwargs, out_val=out))


def _moves_data(func) -> bool:
    if func.namespace not in _COUNTED_NAMESPACES:
        return False
    return not (func.is_view or func.overloadpacket.__name__ in _NO_TRAFFIC)


def _written_args(func, args, kwargs) -> int:
    """Bytes of the arguments an op writes in place (for ops that return nothing, e.g. fused AdamW)."""
    total = 0
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        total += _bytes(value)
    return total


def recomputing() -> bool:
    """Whether the running op belongs to activation checkpointing's recompute: autograd's engine
    runs backward functions with grad mode off, while checkpoint re-runs the forward inside
    backward with grad mode on (also where it stops recomputing early)."""
    return torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()


class WorkCounter(TorchDispatchMode):
    """Counts :class:`Work` while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.work = Work()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = flops_of(func, args, kwargs, out)
        if flops is not None:
            kind, n = flops
            if kind == "attention":
                self.work.attention_flops += n
            else:
                self.work.matmul_flops += n
            if recomputing():
                self.work.recompute_flops += n
        elif _moves_data(func):
            moved = _bytes(args) + _bytes(kwargs) + _bytes(out)
            if not _bytes(out):
                moved += _written_args(func, args, kwargs)
            self.work.memory_bytes += moved
            self.work.memory_kernels += 1
            name = func.overloadpacket.__name__
            self.work.by_op[name] = self.work.by_op.get(name, 0) + moved
        return out
