"""peft's private names hf_tp reads or sets: a LoRA layer's adapter switch, and what a
``ParamWrapper`` (LoRA on an ``nn.Parameter``) keeps of its parameter's layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hf_tp.compat.reaches import reaches

TUNER = "peft.tuners.tuners_utils:BaseTunerLayer"
WRAPPER = "peft.tuners.lora.layer:ParamWrapper"


@reaches(f"{TUNER}._disable_adapters")
def has_adapter_switch(module: Any) -> bool:
    """Whether ``module`` is a peft tuner layer with the flag its forward reads to skip its adapters."""
    return hasattr(module, "_disable_adapters")


@reaches(f"{TUNER}._disable_adapters")
def adapters_disabled(layer: Any) -> bool:
    """Whether peft's tuner ``layer`` skips its adapters now."""
    return layer._disable_adapters


@reaches(f"{TUNER}._disable_adapters")
def set_adapters_disabled(layer: Any, disabled: bool) -> None:
    """Switch ``layer``'s adapters off (or on) for its forward, leaving ``requires_grad`` as it is
    (peft's ``enable_adapters(False)`` also flips it on the adapters, which must stay trainable)."""
    layer._disable_adapters = disabled


@contextlib.contextmanager
def _no_parametrization(active_adapters: list[str]) -> Iterator[None]:
    yield


@reaches(f"{WRAPPER}._activate_lora")
def parametrization_off(wrapper: Any) -> None:
    """Make a ``ParamWrapper``'s forward call its base as is (no update added to the parameter)."""
    wrapper._activate_lora = _no_parametrization


@reaches(sets=(f"{WRAPPER}._param_ndim",))
def wrapped_ndim(wrapper: Any) -> int:
    """The number of dims of the parameter a ``ParamWrapper`` wraps (2: a matrix, 3: stacked experts)."""
    return wrapper._param_ndim


@reaches(sets=(f"{WRAPPER}._did_swap_in_out_features",))
def swapped_in_out(wrapper: Any) -> bool:
    """Whether a ``ParamWrapper`` of stacked experts stores them ``(experts, out, in)``."""
    return wrapper._did_swap_in_out_features
