"""The private hooks of torch's tensor-parallel styles that hf_tp's styles call or override.

A custom style implements ``ParallelStyle._apply`` (torch's one extension point, on the allowlist);
what else hf_tp reuses of ``ColwiseParallel``, ``RowwiseParallel`` and ``PrepareModuleInput`` (their
static partition / input / output functions, one input's redistribution) is here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.tensor.parallel import ColwiseParallel

from hf_tp.compat.reaches import reaches

PARALLEL = "torch.distributed.tensor.parallel"


@reaches(f"{PARALLEL}:ColwiseParallel._prepare_output_fn")
class ColwiseOwnOutput(ColwiseParallel):
    """``ColwiseParallel`` whose local output is a tensor of its own, not a view of the DTensor
    output: attention code that edits projections in place (OLMo's ``query_states.clamp_`` under
    ``clip_qkv``) fails on such a view ("a view ... is being modified inplace"). Costs one copy."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if use_local_output else out


@reaches(f"{PARALLEL}:PrepareModuleInput._prepare_input_arg")
def prepare_input_arg(style: Any, value: Any, mesh: Any, layout: Any, desired: Any) -> Any:
    """``value`` (a tensor in ``layout`` on ``mesh``) redistributed to ``desired``, as the
    ``PrepareModuleInput`` style ``style`` does for each of its inputs."""
    return style._prepare_input_arg(value, mesh, layout, desired)


@reaches(
    f"{PARALLEL}:ColwiseParallel._partition_linear_fn",
    f"{PARALLEL}:ColwiseParallel._prepare_input_fn",
    f"{PARALLEL}:ColwiseParallel._prepare_output_fn",
    f"{PARALLEL}:RowwiseParallel._partition_linear_fn",
    f"{PARALLEL}:RowwiseParallel._prepare_input_fn",
    f"{PARALLEL}:RowwiseParallel._prepare_output_fn",
)
def linear_style_hooks(style: Any) -> tuple[Callable, Callable, Callable]:
    """``(partition, prepare_input, prepare_output)`` of a ``ColwiseParallel`` / ``RowwiseParallel``
    style: how it shards an ``nn.Linear`` (``partition(name, module, mesh)``) and redistributes its
    input (``prepare_input(input_layouts, desired_input_layouts, mod, inputs, mesh)``) and output
    (``prepare_output(output_layouts, use_local_output, mod, outputs, mesh)``)."""
    return style._partition_linear_fn, style._prepare_input_fn, style._prepare_output_fn
