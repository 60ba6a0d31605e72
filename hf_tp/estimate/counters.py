"""What a traced training step counts, from the local ops that reach dispatch: its collectives per
mesh dim (:class:`CommCounter`) and its work (:class:`WorkCounter`: matmul and attention FLOPs,
and the bytes the other, memory-bound, kernels read and write).

Both are ``TorchDispatchMode``s that let DTensor lower to local ops first, so every count is this
rank's share. DTensor (tensor parallel) issues functional collectives (``_c10d_functional``) and
FSDP2 issues c10d ones (``c10d._allgather_base_``...); both pass through dispatch, also under
``FakeTensorMode`` with the fake process group. FLOPs use torch's own formulas
(``torch.utils.flop_counter``); the attention kernel CPU fake tensors dispatch to (the flash
kernel ``_scaled_dot_product_flash_attention_for_cpu``) gets torch's sdpa formulas. Ops run while
autograd recomputes a checkpointed layer in backward are counted apart, so the model FLOPs of the
step (without recompute) are known too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils import flop_counter

from hf_tp.compat.torch_distributed import resolve_process_group
from hf_tp.compat.torch_fake import TorchDispatchMode, active_fake_mode, tree_leaves
from hf_tp.compat.torch_internals import aten_op, in_autograd_backward, op_schema
from hf_tp.core.comm import RING_FACTOR, CommStat

# op packet name -> (collective, where the full-size buffer is: an arg index or "result").
# "Full size" is the gathered output of an all-gather and the input of a reduce-scatter.
_OPS: dict[tuple[str, str], tuple[str, int | str]] = {
    ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", "result"),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): ("all_gather", "result"),
    ("_c10d_functional", "all_gather_into_tensor_out"): ("all_gather", "result"),
    ("_c10d_functional_autograd", "all_gather_into_tensor"): ("all_gather", "result"),
    ("c10d", "_allgather_base_"): ("all_gather", 0),
    ("c10d", "allgather_"): ("all_gather", 0),
    ("c10d", "allgather_into_tensor_coalesced_"): ("all_gather", 0),
    ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", 0),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): ("reduce_scatter", 0),
    ("_c10d_functional_autograd", "reduce_scatter_tensor"): ("reduce_scatter", 0),
    ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", 1),
    ("c10d", "reduce_scatter_"): ("reduce_scatter", 1),
    ("c10d", "reduce_scatter_tensor_coalesced_"): ("reduce_scatter", 1),
    ("_c10d_functional", "all_reduce"): ("all_reduce", 0),
    ("_c10d_functional", "all_reduce_"): ("all_reduce", 0),
    ("_c10d_functional", "all_reduce_coalesced"): ("all_reduce", 0),
    ("_c10d_functional", "all_reduce_coalesced_"): ("all_reduce", 0),
    ("c10d", "allreduce_"): ("all_reduce", 0),
    ("c10d", "allreduce_coalesced_"): ("all_reduce", 0),
    ("_c10d_functional", "broadcast"): ("broadcast", 0),
    ("_c10d_functional", "broadcast_"): ("broadcast", 0),
    ("c10d", "broadcast_"): ("broadcast", 0),
    ("_c10d_functional", "all_to_all_single"): ("all_to_all", 0),
    ("_c10d_functional_autograd", "all_to_all_single"): ("all_to_all", 0),
    ("c10d", "alltoall_base_"): ("all_to_all", 1),
}


def _nbytes(obj) -> int:
    leaves = tree_leaves(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class CommCounter(TorchDispatchMode):
    """Counts collectives and their bytes by (mesh dim, collective) while active.

    ``groups`` maps a process group name to ``(dim name, group size)``; ``by_collective`` maps
    ``(group name, collective)`` to the same and wins over ``groups`` (the ep all-to-alls when the
    ep ranks are all the dp ranks, one process group); ``functional`` maps a group name to the dim
    of its other functional (``_c10d_functional``) collectives and wins over ``groups``: cp's K/V
    gathers when the cp group is also FSDP2's dp x cp group (dp = 1), whose own are c10d ones.
    Collectives on groups of size 1 move nothing and are skipped.
    """

    def __init__(
        self,
        groups: dict[str, tuple[str, int]],
        by_collective: dict[tuple[str, str], tuple[str, int]] | None = None,
        functional: dict[str, tuple[str, int]] | None = None,
    ) -> None:
        super().__init__()
        self.groups = groups
        self.by_collective = by_collective or {}
        self.functional = functional or {}
        self._stats: dict[tuple[str, str], list[int]] = {}
        self._sizes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower to local ops (and collectives) first
        result = func(*args, **(kwargs or {}))
        key = (func.namespace, func.overloadpacket.__name__)
        if key in _OPS:
            self._record(_OPS[key], args, kwargs or {}, result, func.namespace.startswith("_c10d_functional"))
        return result

    def _record(self, op: tuple[str, int | str], args, kwargs, result, functional: bool = False) -> None:
        collective, where = op
        dim, size = self._group_of(args, kwargs, collective, functional)
        if size <= 1:
            return
        full = result if where == "result" else args[where]
        entry = self._stats.setdefault((dim, collective), [0, 0])
        entry[0] += 1
        entry[1] += _nbytes(full)
        self._sizes[dim] = size

    def _group_of(self, args, kwargs, collective: str, functional: bool = False) -> tuple[str, int]:
        """``(dim name, group size)`` of the process group a collective names (by object or name)."""
        groups: list[ProcessGroup] = []
        names: list[str] = []
        for arg in list(args) + list(kwargs.values()):
            if isinstance(arg, torch.ScriptObject):
                try:
                    groups.append(ProcessGroup.unbox(arg))
                except (RuntimeError, TypeError):  # another script object (e.g. a ReduceOp)
                    continue
                names.append(groups[-1].group_name)
            elif isinstance(arg, str):
                names.append(arg)  # a group name, or a reduce op such as "sum"
        for name in names:
            if (name, collective) in self.by_collective:
                return self.by_collective[(name, collective)]
        for name in names if functional else ():
            if name in self.functional:
                return self.functional[name]
        for name in names:
            if name in self.groups:
                return self.groups[name]
        for name in names:  # a group outside the mesh dims
            try:
                groups.append(resolve_process_group(name))
            except (RuntimeError, ValueError, KeyError):
                continue
        return ("other", groups[0].size()) if groups else ("other", 0)

    def stats(self) -> list[CommStat]:
        """One ``CommStat`` per (dim, collective), ordered by dim then collective."""
        out = []
        for (dim, collective), (count, nbytes) in sorted(self._stats.items()):
            n = self._sizes[dim]
            sent = int(nbytes * RING_FACTOR[collective](n))
            out.append(CommStat(dim, collective, n, count, nbytes, sent))
        return out


aten = torch.ops.aten
_GROUPED_MM = aten_op("_grouped_mm")

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
    aten_op("_scaled_dot_product_flash_attention_for_cpu").default: _cpu_flash_forward,
    aten_op("_scaled_dot_product_flash_attention_for_cpu_backward").default: _cpu_flash_backward,
}


def flops_of(func, args, kwargs, out) -> tuple[str, int] | None:
    """``("matmul" | "attention", flops)`` of one local op, or None for an op without a formula."""
    if func in _ATTENTION_EXTRA:
        return "attention", int(_ATTENTION_EXTRA[func](*args, **kwargs))
    packet = func.overloadpacket
    if packet is _GROUPED_MM:
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
    for i, arg in enumerate(op_schema(func).arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        total += _nbytes(value)
    return total


def recomputing() -> bool:
    """Whether the running op belongs to activation checkpointing's recompute: autograd's engine
    runs backward functions with grad mode off, while checkpoint re-runs the forward inside
    backward with grad mode on (also where it stops recomputing early)."""
    return in_autograd_backward() and torch.is_grad_enabled()


class WorkCounter(TorchDispatchMode):
    """Counts :class:`Work` while active (see the module docstring).

    Only ops run under the fake mode active on entry (None: real tensors) are counted. DTensor
    works out each op's output shape by running it once more on *global*-shape tensors in a fake
    mode of its own (:func:`hf_tp.compat.torch_fake.separate_sharding_fake_mode`); those runs,
    one per new sharding (e.g. a whole unsharded MLP), are no work of this rank's, as MemTracker
    also skips them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.work = Work()
        self._fake_mode = None

    def __enter__(self):
        self._fake_mode = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if active_fake_mode() is not self._fake_mode:
            return out  # DTensor's shape propagation (global shapes), not this rank's work
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
            moved = _nbytes(args) + _nbytes(kwargs) + _nbytes(out)
            if not _nbytes(out):
                moved += _written_args(func, args, kwargs)
            self.work.memory_bytes += moved
            self.work.memory_kernels += 1
            name = func.overloadpacket.__name__
            self.work.by_op[name] = self.work.by_op.get(name, 0) + moved
        return out
