"""Styles for a block whose kind or call changes by decoder layer (per-layer mixers).

A hybrid model may build one layer-level child under one name that is a different module in
different layers: Nemotron-H's ``mixer`` is Mamba, attention, an MLP or a MoE block by layer
index; MiniMax's ``self_attn`` is linear (lightning) attention or softmax attention. A plan has one
entry per path, so the entry chooses, per layer, the style of the module it finds there
(:class:`ByKind`, by the module's class). Such layers may also pass the hidden states to the
child differently by kind (by keyword to attention, by position to an MLP): :class:`GatherAsCalled`
all-gathers them however each call passes them.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

from hf_tp.compat.torch_styles import prepare_input_arg


class PerLayerChoice(ParallelStyle):
    """A plan entry that is one of several styles, chosen per layer from the module it is applied to."""

    def select(self, module: nn.Module) -> ParallelStyle | None:
        """The style this module gets (None: nothing to apply)."""
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        chosen = self.select(module)
        return module if chosen is None else chosen._apply(module, device_mesh)


class ByKind(PerLayerChoice):
    """The style of the module's class (``styles``: class name -> style). A class the derivation
    did not see is an error naming it, never a guessed placement."""

    def __init__(self, styles: dict[str, ParallelStyle | None]) -> None:
        super().__init__()
        self.styles = dict(styles)

    def select(self, module: nn.Module) -> ParallelStyle | None:
        name = type(module).__name__
        if name not in self.styles:
            raise ValueError(
                f"hf_tp's plan has no style for a {name} here (it knows {', '.join(sorted(self.styles))}): the model "
                "differs from the one the plan was derived from; derive the adapter from this model's config"
            )
        return self.styles[name]


def resolve(style: ParallelStyle | None, module: nn.Module) -> ParallelStyle | None:
    """``style`` as it applies to ``module``: per-layer choices made (recursively)."""
    while isinstance(style, PerLayerChoice):
        style = style.select(module)
    return style


class GatherAsCalled(PrepareModuleInput):
    """All-gather a block's hidden states from sequence shards, passed by the keyword
    ``hidden_states`` or else as the first positional argument, whichever each call does (a layer
    whose calls of the block differ by layer kind). ``use_local_output`` as ``PrepareModuleInput``'s."""

    def __init__(self, use_local_output: bool = False) -> None:
        super().__init__(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=use_local_output
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(mod: nn.Module, args: tuple, kwargs: dict):
            if "hidden_states" in kwargs:
                value = prepare_input_arg(self, kwargs["hidden_states"], device_mesh, Shard(1), Replicate())
                return args, {**kwargs, "hidden_states": value}
            if not args:
                raise ValueError(f"{type(mod).__name__} was called without hidden states (no positional argument)")
            return (prepare_input_arg(self, args[0], device_mesh, Shard(1), Replicate()), *args[1:]), kwargs

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module
