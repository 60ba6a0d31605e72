"""Small questions about modules and configs that the adapters, the loss and the estimate ask."""

from __future__ import annotations

from torch import nn

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def has_submodule(module: nn.Module, path: str) -> bool:
    """``module.get_submodule(path)`` exists."""
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def has_parameter(module: nn.Module, path: str) -> bool:
    """``module.get_parameter(path)`` exists."""
    try:
        module.get_parameter(path)
    except AttributeError:
        return False
    return True


def is_linear(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a subclass with a forward of its own)."""
    return type(module) is nn.Linear


def is_norm(module: nn.Module, size: int) -> bool:
    """A leaf whose parameters are all vectors of ``size`` (a norm's weight and bias)."""
    params = list(module.parameters(recurse=False))
    has_children = any(True for _ in module.children() if any(True for _ in _.parameters()))
    return bool(params) and not has_children and all(p.dim() == 1 and p.numel() == size for p in params)


def shapes(module: nn.Module) -> str:
    """``"weight (64,), bias (64,)"``: a module's parameters for an error message."""
    return ", ".join(f"{n} {tuple(p.shape)}" for n, p in module.named_parameters()) or "no parameters"


def num_experts(config) -> int | None:
    """The routed-expert count of a MoE config (families name the field differently), else None."""
    for name in EXPERT_COUNT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


# The names families give their top-k (a list per layer in some: its first entry)
TOP_K_FIELDS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_topk",
    "moe_k",
    "experts_per_token",
    "top_k",
    "top_k_experts",
)


def experts_per_token(config) -> int | None:
    """How many routed experts each token uses (top-k; families name the field differently), else None."""
    for name in TOP_K_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, list | tuple) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def expert_holders(module: nn.Module, config) -> list[str]:
    """Submodules of ``module`` that hold routed experts: an ``experts`` child, or own parameters
    stacked one per expert (3-D, leading dim the config's expert count)."""
    count = num_experts(config)
    out = []
    for path, sub in module.named_modules():
        stacked = any(p.dim() == 3 and p.shape[0] == count for p in sub.parameters(recurse=False))
        if path.rsplit(".", 1)[-1] == "experts" or (count and stacked):
            out.append(path)
    return out


def stream_mixers(parent: nn.Module, hidden: int) -> list[str]:
    """Children of ``parent`` that mix a residual stream of several copies per token
    (hyper-connections: DeepSeek-V4's ``attn_hc``/``hc_head``, Qwen4-Exp's gated residuals): a
    module (not a plain Linear) holding a matrix that reads the streams flattened (a multiple
    k >= 2 of ``hidden`` input features) and none that reads a single ``hidden`` one (an MLP or
    attention block reads the hidden states themselves)."""
    out = []
    for name, child in parent.named_children():
        if is_linear(child) or isinstance(child, nn.ModuleList | nn.Embedding):
            continue
        reads = {p.shape[-1] for p in child.parameters() if p.dim() >= 2}
        if hidden not in reads and any(w % hidden == 0 and w > hidden for w in reads):
            out.append(name)
    return out
