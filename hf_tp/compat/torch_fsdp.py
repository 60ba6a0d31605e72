"""FSDP2's private state hf_tp drives: its lazy init (generate) and, in pipeline stages, its parameter
groups, gathered parameters and end-of-backward callback (:mod:`hf_tp.pipeline.pipeline_fsdp`)."""

from __future__ import annotations

from typing import Any

from hf_tp.compat.reaches import reaches

STATE = "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState"
PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam"


@reaches("torch.distributed.fsdp:FSDPModule._get_fsdp_state", f"{STATE}._lazy_init")
def fsdp_lazy_init(model: Any) -> None:
    """Set up FSDP2's root state of ``model`` now (a no-op once set up); torch has no public API."""
    model._get_fsdp_state()._lazy_init()


@reaches(f"{STATE}()._fsdp_param_groups")
def param_groups(state: Any) -> list:
    """The FSDP2 parameter groups of one unit's state (``fully_shard.state(module)``)."""
    return state._fsdp_param_groups


@reaches(f"{STATE}._root_post_backward_final_callback")
def root_post_backward(state: Any) -> None:
    """Run a root state's end-of-backward callback by hand (what FSDP2 queues after its backward)."""
    state._root_post_backward_final_callback()


@reaches(sets=(f"{PARAM}._unsharded_param",))
def unsharded_params(fsdp_params: list[Any]) -> list[Any]:
    """The gathered copies of those of ``fsdp_params`` (FSDP2 parameters) that have one now (FSDP2
    makes it lazily)."""
    return [fp._unsharded_param for fp in fsdp_params if hasattr(fp, "_unsharded_param")]


@reaches(f"{STATE}._root_post_backward_final_callback", f"{STATE}()._fsdp_param_groups")
def internals_present(root: Any, units: list[Any]) -> bool:
    """Whether a root's FSDP2 state and its units' states expose what
    :mod:`hf_tp.pipeline.pipeline_fsdp` drives (torch 2.13's names: a torch that renamed them is
    refused there, on every rank alike)."""
    return (
        hasattr(root, "_root_post_backward_final_callback")
        and all(hasattr(s, "_fsdp_param_groups") for s in units)
        and _param_internals()
    )


@reaches(sets=(f"{PARAM}._unsharded_param",))
def _param_internals() -> bool:
    """Whether torch's FSDP2 parameter keeps its gathered copy in ``_unsharded_param`` (set lazily:
    checked on the class)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:
        return False
    return "_unsharded_param" in getattr(FSDPParam, "__annotations__", {})
