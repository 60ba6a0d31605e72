"""Materializing a model that was parallelized on the meta device, without losing what
:func:`hf_tp.parallelize` attached to its parameters.

parallelize registers gradient hooks on some parameters (the dp average of expert-parallel
experts at ep = dp, of odd-dtype parameters kept outside FSDP2) and keeps sets that name parameter
objects. ``nn.Module.to_empty`` replaces a plain parameter with a new object, and swaps a DTensor
parameter's contents into the same object while its hooks stay with the old contents: a gradient
is then silently left unaveraged. The functions here keep every parameter object and its hooks.
"""

from __future__ import annotations

import threading
import types

import torch
from torch import nn

from hf_tp.compat.torch_internals import reinstall_backward_hooks

_SWAP_LOCK = threading.Lock()  # torch.__future__'s switch is process-wide (threaded test worlds)


def to_empty_keeping_parameters(model: nn.Module, device: torch.device | str, recurse: bool = True) -> nn.Module:
    """``model.to_empty(device=device)`` that keeps every parameter the same object, with its
    gradient hooks: every parameter is swapped (torch's opt-in), then each one's hook dict is
    installed on its new contents (assigning it is what installs it)."""
    with _SWAP_LOCK:
        before = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            nn.Module.to_empty(model, device=device, recurse=recurse)  # the class's: not a patched one
        finally:
            torch.__future__.set_swap_module_params_on_conversion(before)
    for param in model.parameters(recurse=recurse):
        reinstall_backward_hooks(param)
    return model


def keep_parameters_on_to_empty(*modules: nn.Module) -> None:
    """Make ``m.to_empty(device=...)`` of each of ``modules`` (a parallelized meta model, and its
    peft wrapper) :func:`to_empty_keeping_parameters`, the step users take to materialize it."""
    for module in modules:
        module.to_empty = types.MethodType(_to_empty, module)


def _to_empty(self: nn.Module, *, device: torch.device | str, recurse: bool = True) -> nn.Module:
    return to_empty_keeping_parameters(self, device, recurse)
