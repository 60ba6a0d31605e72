"""A multimodal wrapper's passengers under hf_tp: what it refuses, and the frozen vision tower.

hf_tp trains a wrapper (:mod:`hf_tp.adapters.wrapper`) on text: its language model and lm_head
are parallelized as the text model's, and the vision (or audio) tower and projector never run.
They get no gradient, so they are frozen (``requires_grad`` False: no optimizer state, no
gradient reduction) and refuse to run, naming what is missing, rather than fail inside torch on
mixing their plain outputs with the sharded token stream.
"""

from __future__ import annotations

from torch import nn

from hf_tp.adapters.adapter import Adapter


def check_wrapper(adapter: Adapter, *, peft: bool, ep: int, cp: bool) -> None:
    """Refuse, in one line, what hf_tp has not verified on a multimodal wrapper."""
    if not adapter.language_model:
        return
    unverified = [
        what
        for what, asked in (
            ("LoRA", peft),
            ("expert parallelism (ep > 1)", ep > 1),
            ("context parallelism (cp > 1)", cp),
        )
        if asked
    ]
    if unverified:
        raise ValueError(
            f"hf_tp trains a multimodal {adapter.model_type} checkpoint's language model without "
            f"{' or '.join(unverified)} for now: not yet checked against plain transformers on wrappers"
        )


def passenger_parameters(model: nn.Module, adapter: Adapter) -> list[tuple[str, nn.Parameter]]:
    """The wrapper's parameters outside its language model and lm_head (vision tower, projector)."""
    return [(n, p) for n, p in model.named_parameters() if adapter.is_passenger(n)]


def freeze_passengers(model: nn.Module, adapter: Adapter) -> int:
    """Freeze the passengers and make them refuse to run; returns how many elements were frozen."""
    frozen = 0
    for _, p in passenger_parameters(model, adapter):
        p.requires_grad_(False)
        frozen += p.numel()
    modules = dict(model.named_modules())
    for path in adapter.passengers:
        if path in modules:
            modules[path].register_forward_pre_hook(_refuse_to_run(adapter.model_type, path))
    return frozen


def describe(model: nn.Module, adapter: Adapter) -> str:
    """One line for a run's start: what trains and what is frozen."""
    frozen = sum(p.numel() for _, p in passenger_parameters(model, adapter))
    tops = sorted({path.split(".")[-1] for path in adapter.passengers})
    return (
        f"hf-tp: {adapter.model_type} is a multimodal checkpoint: training its language model "
        f"({adapter.language_model}) and lm_head on text; {', '.join(tops)} ({frozen:,} parameters) frozen"
    )


def _refuse_to_run(model_type: str, path: str):
    def hook(module: nn.Module, args) -> None:
        raise ValueError(
            f"hf_tp trains a multimodal {model_type} checkpoint on text only for now: its {path} was called "
            "(images or other non-text inputs were passed); pass token ids only"
        )

    return hook
