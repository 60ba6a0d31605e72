"""Comparisons of a parallel run with its single-rank reference: global views of sharded tensors,
the largest error of a set of tensors, and the weights after AdamW steps.

Shared by ``hf-tp verify`` and the test grids (tests/parity.py), so both hold a layout to the same
standard. Each function returns its measure; the caller decides what passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_tp.moe.expert_styles import hf_shapes
from hf_tp.run.optim import ADAMW_BETAS

# Biases added to every key (k_proj, the packed query_key_value, a key LayerNorm): their gradient is zero in
# exact arithmetic (softmax ignores a per-query constant q.b_k), so their Adam update is round-off.
KEY_BIASES = ("k_proj.bias", "query_key_value.bias", "k_layernorm.bias", "k_norm.bias")


MOVED_FLOOR = 1e-4
# How closely both runs must agree on a gradient under the magnitude floor for it to count as
# resolved: the AdamW check's own tolerance, which AdamW's updates then differ by at most.
AGREE = 1e-3


@dataclass(frozen=True)
class Error:
    """The largest difference over a set of tensors: absolute, and relative to the largest
    magnitude of the reference tensor it occurred in (so a tensor of small values is held to
    its own scale); ``where`` names the tensor with the largest relative error."""

    abs: float = 0.0
    rel: float = 0.0
    where: str = ""
    missing: tuple[str, ...] = ()  # names one side has and the other lacks

    def text(self) -> str:
        if self.missing:
            return f"names differ: {', '.join(self.missing[:4])}"
        return f"max abs {self.abs:.2e}, rel {self.rel:.2e}" + (f" ({self.where})" if self.where else "")


def full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a DTensor (collective over its mesh), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Global gradients in HF's shapes (hf_tp stores packed expert weights with their halves apart)."""
    shapes = hf_shapes(model)
    return {
        n: full(p.grad).detach().reshape(shapes.get(n, p.shape)).clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def full_params(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Global parameters in HF's shapes (``trainable_only``: those with ``requires_grad``)."""
    shapes = hf_shapes(model)
    return {
        n: full(p.detach()).reshape(shapes.get(n, p.shape)).clone()
        for n, p in model.named_parameters()
        if p.requires_grad or not trainable_only
    }


def full_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer (rotary tables and the like), global."""
    return {n: full(b.detach()).clone() for n, b in model.named_buffers()}


def tensor_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> Error:
    """The largest error of ``got`` against ``want``, tensor by tensor (a NaN counts as infinite)."""
    missing = tuple(sorted(got.keys() ^ want.keys()))
    if missing:
        return Error(missing=missing)
    worst = Error()
    for name, w in want.items():
        g = got[name].to(w.device, w.dtype)
        if g.shape != w.shape:
            return Error(math.inf, math.inf, f"{name}: shape {tuple(g.shape)} vs {tuple(w.shape)}")
        diff = (g.double() - w.double()).abs()
        d = diff.max().item() if diff.numel() else 0.0
        d = math.inf if math.isnan(d) else d
        scale = w.double().abs().max().item() if w.numel() else 0.0
        rel = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
        if rel > worst.rel or (rel == worst.rel and d > worst.abs):
            worst = Error(max(d, worst.abs), rel, name)
        else:
            worst = Error(max(d, worst.abs), worst.rel, worst.where)
    return worst


Grads = dict[str, torch.Tensor]


def adam_error(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
    grads: Grads | list[Grads] | None = None,
    got_grads: Grads | list[Grads] | None = None,
    max_unresolved: float = 1e-3,
    uncapped: tuple[str, ...] = (),
    judged: int | None = None,
) -> Error:
    """Weights after AdamW steps: the largest, over tensors, of |W_got - W_want| / (|W_want - W_start|
    + 1e-4) (norms) over the elements whose updates are resolved; ``rel`` is that ratio (the
    1e-4: a tensor that barely moved is allowed 1e-7 of round-off at a tolerance of 1e-3).

    An element-wise test is ill-posed after Adam: its first update is lr * g / (|g| + eps), about
    lr * sign(g), so an element whose true gradient is ~0 moves by +-lr on round-off alone. Such
    elements (given ``grads``, the reference's gradients: nonzero |g| under 1e-5 of the
    tensor's RMS gradient, scaled by the dtype's epsilon) are left out; at most ``max_unresolved``
    of a tensor may be (far less than one tp shard of it), or the tensor counts as failed
    (``where`` says so). Given ``got_grads`` too, a small gradient on which both runs agree to a
    ``AGREE`` of itself is resolved (exact but small, not round-off: a tied LM head's rows of tokens the
    batch lacks get the softmax tail), and an element whose gradient differs by over a tenth of itself
    is not resolved (at most 1 in 100): a float64 model that computes parts in fp32 has fp32
    round-off in its gradients.

    ``grads`` / ``got_grads``: the first step's gradients, or every step's (a list, oldest first,
    as the optimizer saw them): then each step's update, AdamW's first moment over the root of its
    second (both decayed sums of the steps so far), is judged by the rules above with that root in
    place of |g| and the first moment's round-off floor and the two runs' first-moment difference
    in place of the gradient's (at one step, exactly the rules above). A gradient near zero at a
    later step is no round-off update while the moments carry resolved earlier ones.
    ``judged``: how many of the last steps moved ``start`` to the weights compared (default: all;
    a resumed step is the last one of three).

    ``uncapped``: name prefixes of parameters whose unresolved elements are left out without those
    caps: hyper-connection mixers (fp32 inside a float64 model). Their first layer takes k copies of
    one embedding, so the weights that collapse the streams (a scale-invariant norm follows) and mix
    them (doubly stochastic: every column sums to one) get whole rows of gradients that are zero in
    exact arithmetic, and near it in the next mixers; the element-wise gradient check covers them.
    """
    if missing := tuple(sorted(got.keys() ^ want.keys())):
        return Error(missing=missing)
    history, got_history = _steps(grads), _steps(got_grads)
    worst = Error()
    for name, w in want.items():
        if name.endswith(KEY_BIASES):  # exactly zero gradient in exact arithmetic: its update is round-off
            continue
        capped = max_unresolved if not name.startswith(uncapped) else 1.0
        resolved, problem = _resolved(name, w, history, got_history, capped, judged)
        if problem:
            return Error(math.inf, math.inf, problem)
        moved = (w - start[name])[resolved].norm().item()
        err = (got[name].to(w.device, w.dtype) - w)[resolved].norm().item()
        err = math.inf if math.isnan(err) else err
        rel = err / (moved + MOVED_FLOOR)
        if rel > worst.rel:
            worst = Error(err, rel, name)
    return worst


def _steps(grads: Grads | list[Grads] | None) -> list[Grads] | None:
    return [grads] if isinstance(grads, dict) else grads


def _resolved(
    name: str,
    w: torch.Tensor,
    grads: list[Grads] | None,
    got_grads: list[Grads] | None,
    max_unresolved: float,
    judged: int | None,
) -> tuple[torch.Tensor, str | None]:
    """The elements of ``w`` whose judged updates are all resolved, or a reason the tensor cannot pass."""
    resolved = torch.ones_like(w, dtype=torch.bool)
    if not grads or not any(name in g for g in grads):  # a parameter used without gradient has none: all resolved
        return resolved, None
    # the layout's gradients where it has them at the same steps (else the reference's rules alone, as before)
    both = got_grads is not None and len(got_grads) == len(grads)
    both = both and all((name in g) == (name in h) for g, h in zip(grads, got_grads, strict=True))
    first = len(grads) - (judged or len(grads))
    like = next(g[name] for g in grads if name in g)
    floor = 1e-5 * torch.finfo(like.dtype).eps / torch.finfo(torch.float32).eps
    beta1, beta2 = ADAMW_BETAS
    square, apart, low = (torch.zeros(like.shape, dtype=torch.float64, device=like.device) for _ in range(3))
    noisy = torch.zeros_like(resolved)
    for t, step in enumerate(grads):
        g = step[name].double() if name in step else torch.zeros_like(square)  # (no gradient this step: zero)
        scale = g[g != 0].pow(2).mean().sqrt() if g.any() else 0.0
        square = beta2 * square + (1 - beta2) * g * g  # AdamW's second moment: what an update is divided by
        low = beta1 * low + (1 - beta1) * floor * scale  # the first moment's round-off
        if both:
            other = got_grads[t][name].to(g.device, g.dtype) if name in got_grads[t] else g
            apart = beta1 * apart + (1 - beta1) * (other - g)  # how far apart the two runs' first moments are
        if t < first:
            continue
        # the update is the first moment over the RMS (bias-corrected); what moves it is the first
        # moment's error over that RMS (at the first step: the gradient's error over the gradient)
        rms, noise = (square / (1 - beta2 ** (t + 1))).sqrt(), apart.abs() / (1 - beta1 ** (t + 1))
        ok = (rms == 0) | (rms >= low / (1 - beta1 ** (t + 1)))  # exact zeros (absent tokens' rows) are exact
        if both:
            # a small gradient that is no cancellation (a tied LM head's rows of tokens the batch lacks:
            # the softmax tail) is as exact as a large one: where both runs agree on it to AGREE of
            # itself, AdamW's updates (about lr times g over its running RMS) agree as closely
            ok |= AGREE * rms >= noise
            noisy |= ok & (rms != 0) & (rms < 10 * noise)
        resolved &= ok
    unresolved = int((~resolved).sum())
    if unresolved > int(w.numel() * max_unresolved):
        return resolved, f"{name}: {unresolved} of {w.numel()} gradients are ~0"
    if both:
        noisy &= resolved
        if int(noisy.sum()) > int(w.numel() * max(max_unresolved, 0.01)):
            return resolved, f"{name}: {int(noisy.sum())} gradients within noise"
        resolved &= ~noisy
    return resolved, None


def stream_mixer_params(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes of the hyper-connection mixers' parameters in ``model`` (a causal LM), as its
    plan places them: :func:`adam_error`'s ``uncapped``. None where the model has no such mixers
    (or its layers are not where its adapter says: a wrapper)."""
    from hf_tp.adapters.adapter import PlanOptions
    from hf_tp.adapters.registry import get_adapter
    from hf_tp.styles import HyperConnectionOnShards

    adapter = get_adapter(model.config)
    opts = PlanOptions()
    try:
        count = len(model.get_submodule(adapter.layers_path))
    except AttributeError:
        return ()
    mixers = [p for p, s in adapter.top_plan(opts).items() if isinstance(s, HyperConnectionOnShards)]
    inner = [p for p, s in adapter.layer_plan(opts).items() if isinstance(s, HyperConnectionOnShards)]
    mixers += [f"{adapter.layers_path}.{i}.{p}" for i in range(count) for p in inner]
    return tuple(f"{p}." for p in mixers)
