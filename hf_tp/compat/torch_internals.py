"""``nn.Module``'s slots, instance attributes that shadow them, autograd's engine, private ops.

hf_tp shards a parameter by registering a DTensor and, for a forward, letting an instance
attribute of the same name shadow it (``nn.Module.__getattr__`` is asked only for names the
instance's ``__dict__`` lacks, and parameters, buffers and submodules live in ``_parameters``,
``_buffers`` and ``_modules``, never in ``__dict__``). The probes check that this still holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_tp.compat.reaches import reaches, register

MODULE = "torch.nn:Module()"
COMPILED = "torch._dynamo.eval_frame:OptimizedModule"
COMPILED_CHILD = "_orig_mod"  # the child torch.compile's wrapper (OptimizedModule) holds the model as
register(f"{__name__}.COMPILED_CHILD", sets=(f"{COMPILED}.{COMPILED_CHILD}",))


def _shadowing() -> str | None:
    """A probe: an instance attribute shadows a registered parameter, and dropping it shows the parameter again."""
    import torch

    linear = torch.nn.Linear(1, 1)
    view = torch.zeros(1, 1)
    set_own_attribute(linear, "weight", view)
    shadowed = linear.weight is view
    pop_own_attribute(linear, "weight")
    if shadowed and linear.weight is parameter_slots(linear)["weight"]:
        return None
    return "an instance attribute no longer shadows an nn.Module's parameter of the same name"


@reaches(f"{MODULE}._parameters")
def parameter_slots(module: Any) -> dict[str, Any]:
    """``module``'s own registered parameters by name (the dict itself: FSDP2's current tensors, never
    a shadowing instance attribute; entries may be None)."""
    return module._parameters


@reaches(f"{MODULE}._buffers", f"{MODULE}._non_persistent_buffers_set")
def buffer_slots(module: Any) -> tuple[dict[str, Any], set[str]]:
    """``module``'s own registered buffers by name, and the names of those it does not save."""
    return module._buffers, module._non_persistent_buffers_set


@reaches(f"{MODULE}._modules")
def child_slots(module: Any) -> dict[str, Any]:
    """``module``'s registered children by name (the dict itself; entries may be None)."""
    return module._modules


@reaches(MODULE, check=_shadowing)
def own_attribute(obj: Any, name: str) -> Any:
    """``obj``'s own instance attribute ``name`` or None: never a parameter, buffer or submodule of
    an ``nn.Module``, nor a class attribute."""
    return obj.__dict__.get(name)


@reaches(MODULE, check=_shadowing)
def set_own_attribute(obj: Any, name: str, value: Any) -> None:
    """Set an instance attribute without ``nn.Module.__setattr__``: on a module it shadows the
    parameter (or submodule) ``name`` until :func:`pop_own_attribute`, which it leaves registered."""
    obj.__dict__[name] = value


@reaches(MODULE, check=_shadowing)
def pop_own_attribute(obj: Any, name: str) -> Any:
    """Remove ``obj``'s own instance attribute ``name`` (if any) and return it (a shadowed parameter
    shows again)."""
    return obj.__dict__.pop(name, None)


def copy_instance(obj: Any, cls: type) -> Any:
    """A shallow copy of ``obj`` of class ``cls`` (a subclass of its own) made without ``__init__``."""
    import copy

    out = cls.__new__(cls)
    out.__dict__.update(copy.copy(obj.__dict__))
    return out


@reaches("torch:Tensor._backward_hooks")
def reinstall_backward_hooks(param: Any) -> None:
    """Install a parameter's hook dict on its current contents again (assigning it installs it:
    a swapped parameter keeps the dict but not the installation)."""
    if param._backward_hooks:
        param._backward_hooks = param._backward_hooks


@reaches("torch._C:_current_graph_task_id")
def in_autograd_backward() -> bool:
    """Whether autograd's engine is running a backward pass in this thread now (also where
    activation checkpointing re-runs a forward inside it)."""
    import torch

    return torch._C._current_graph_task_id() != -1


@reaches("torch.autograd:Variable._execution_engine")
def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass ends (autograd's engine queue)."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(callback)


@reaches("torch._dynamo:disable")
def eager_only(fn: Callable) -> Callable:
    """``fn`` run eagerly, never traced by ``torch.compile`` (also inside a compiled region)."""
    import torch

    return torch._dynamo.disable(fn)


PRIVATE_OPS = (
    "_grouped_mm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)


@reaches(*(f"torch:ops.aten.{name}" for name in PRIVATE_OPS))
def aten_op(name: str) -> Any:
    """The private aten op ``name`` (one of :data:`PRIVATE_OPS`: an op packet; ``.default`` its overload)."""
    import torch

    if name not in PRIVATE_OPS:
        raise ValueError(f"{name} is not one of hf_tp's probed private ops {PRIVATE_OPS}")
    return getattr(torch.ops.aten, name)


@reaches("torch:ops.aten.add.default._schema")
def op_schema(func: Any) -> Any:
    """An op overload's schema (its arguments, which of them it writes)."""
    return func._schema


def _last_lr_read() -> str | None:
    """A probe: ``LRScheduler.get_last_lr`` reports what the scheduler keeps in ``_last_lr``."""
    import inspect

    from torch.optim.lr_scheduler import LRScheduler

    found = "self._last_lr" in inspect.getsource(LRScheduler.get_last_lr)
    return None if found else "torch.optim.lr_scheduler.LRScheduler.get_last_lr no longer reads _last_lr"


@reaches(
    "torch.optim.lr_scheduler:LRScheduler.get_last_lr",
    sets=("torch.optim.lr_scheduler:LRScheduler._last_lr",),
    check=_last_lr_read,
)
def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """Set what ``scheduler.get_last_lr()`` reports (schedulers keep it in ``_last_lr``)."""
    scheduler._last_lr = lrs
