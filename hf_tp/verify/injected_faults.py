"""Faults ``hf-tp verify`` can be told to inject into the layout under test, to show that it
catches them: a test-only hook (never set it in a real check), read from ``HF_TP_VERIFY_FAULT``.

- ``rowwise-as-colwise``: the first row-parallel module of the decoder-layer plan (an attention
  output projection, say) is sharded column-wise instead, as a wrong plan would;
- ``stale-rotary``: the rotary tables (``inv_freq`` buffers) left at zeros after the meta build,
  as a loader that forgets computed buffers leaves them (torchtitan #3775).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hf_tp.adapters.registry import changed_adapters

FAULT_ENV = "HF_TP_VERIFY_FAULT"
FAULTS = ("rowwise-as-colwise", "stale-rotary")


def requested() -> str | None:
    """The fault named in the environment, or None; a ``ValueError`` for an unknown one."""
    fault = os.environ.get(FAULT_ENV) or None
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={fault!r} is not a fault verify knows; known: {', '.join(FAULTS)}")
    return fault


@contextlib.contextmanager
def while_building(fault: str | None) -> Iterator[None]:
    """Around the candidate's parallelize: the wrong plan, for ``rowwise-as-colwise`` (the adapter
    look-up changed for this thread only: :func:`hf_tp.adapters.registry.changed_adapters`)."""
    if fault != "rowwise-as-colwise":
        yield
        return
    with changed_adapters(_wrong_plan):
        yield


def _wrong_plan(adapter):
    """``adapter`` with its first row-parallel layer style made column-parallel."""
    layer_plan = adapter.layer_plan

    def plan(opts):
        styles = dict(layer_plan(opts))
        first = next((p for p, s in styles.items() if isinstance(s, RowwiseParallel)), None)
        if first is not None:
            styles[first] = ColwiseParallel()
        return styles

    return dataclasses.replace(adapter, layer_plan=plan)


def after_build(model: nn.Module, fault: str | None) -> None:
    """After the candidate is built and loaded: zeroed rotary tables, for ``stale-rotary``."""
    if fault != "stale-rotary":
        return
    for name, buffer in model.named_buffers():
        if name.endswith("inv_freq"):
            buffer.zero_()
