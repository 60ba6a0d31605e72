"""Linear styles beyond torch's ``ColwiseParallel``/``RowwiseParallel``."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel


class ColwiseOwnOutput(ColwiseParallel):
    """``ColwiseParallel`` whose local output is a tensor of its own, not a view of the DTensor
    output: attention code that edits projections in place (OLMo's ``query_states.clamp_`` under
    ``clip_qkv``) fails on such a view ("a view ... is being modified inplace"). Costs one copy."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if use_local_output else out
