"""Per-head parameters held by an attention module itself (attention sinks), sharded by head."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class LocalHeadParams(ParallelStyle):
    """Shard the module's parameters ``names`` (one entry per attention head on dim 0) over tp with
    the heads, and let its forward see only the local heads' entries: a plain tensor view whose
    gradient flows back into the sharded parameter. Attention code indexes them with its local
    heads (``module.sinks``), where a DTensor would mix with plain tensors."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            param = module._parameters[name]
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]), param.requires_grad)
            )
        names = self.names

        def local_views(mod: nn.Module, args) -> None:
            for name in names:  # an instance attribute shadows the registered parameter for the call
                mod.__dict__[name] = mod._parameters[name].to_local()

        def drop_views(mod: nn.Module, args, output):
            for name in names:
                mod.__dict__.pop(name, None)
            return output

        module.register_forward_pre_hook(local_views)
        module.register_forward_hook(drop_views)
        return module


class Compose(ParallelStyle):
    """Several styles on one module, applied in order (a plan has one entry per module path)."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module
