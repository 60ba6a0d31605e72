"""The collectives a plan makes per decoder layer and at the top level, derived from its styles.

Megatron's sequence-parallel rules, read off each :class:`hf_tp.plan.styles.Part` (checked
against the collectives a real parallelized model issues, counted on a fake process group, in
``tests/unit/test_plan.py``): a block that gathers its input all-gathers the hidden states in the
forward and reduce-scatters their gradient in the backward; a row-parallel projection
reduce-scatters its output to sequence shards (backward: all-gathers the gradient); a gathered
column-parallel projection all-gathers its output; a block that runs whole all-gathers its input
and hands back a slice (backward: all-gathers the output gradient). Sizes as
:mod:`hf_tp.estimate.counters` counts them (the full-size buffer) and sums them
(:class:`~hf_tp.estimate.counters.CommStat`, with the bytes one rank sends in a ring).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from hf_tp.core.comm import RING_FACTOR, CommStat
from hf_tp.plan.model_plan import Collective
from hf_tp.plan.styles import Part

FP32 = 4  # norms over a split width and the loss reduce in fp32; so does the fused gradient all-reduce
Item = tuple[list[Collective], list[Collective]]  # (forward, backward) of one step of a block


@dataclass(frozen=True)
class Sizes:
    """What the byte counts depend on."""

    tokens: int  # batch x sequence on one cp rank: what a tp group gathers
    hidden: int
    itemsize: int
    tp: int
    cp: int = 1
    ep: int = 1
    top_k: int = 0


def _c(op: str, dim: str, where: str, elements: int, itemsize: int) -> Collective:
    return Collective(op, dim, where, elements, itemsize)


def block_collectives(
    block: nn.Module,
    name: str,
    own: list[Part],
    inside: list[tuple[str, nn.Module, list[Part]]],
    s: Sizes,
    kv: tuple[int, int] | None,
) -> list[Item]:
    """The steps of one block (a decoder layer's child ``block`` at ``name``) in forward order:
    gathering its input, its modules' own collectives, cp's K/V gathers (``kv``: the K and V widths
    one rank gathers), and the way back to sequence shards (a row-parallel projection's or the
    block's own). A module inside a key selector (a sparse-attention indexer: its output is a
    choice of keys, through which no gradient flows) has no backward collective."""
    kinds = {p.kind for p in own}
    whole = "whole_block" in kinds
    head, tail = _block_ends(name, kinds, s, routed=takes_routing(block))
    mid: list[Item] = []
    selectors = [f"{name}.{path}." for path, m in block.named_modules() if "Indexer" in type(m).__name__]
    for p in own:  # a projection the layer calls itself (the up and down projections of OPT's MLP)
        if p.kind in ("rowwise", "rowwise_all_reduce"):
            tail.insert(0, _rowwise(name, block, False, s) if p.kind == "rowwise" else _all_reduced(name, block, s))
    for path, module, ps in inside:
        for p in ps:
            if p.kind.startswith("rowwise") and p.kind not in ("rowwise_plain", "rowwise_all_reduce"):
                tail.insert(0, _rowwise(path, module, p.kind == "rowwise_gathered", s))
            elif (item := _inside(path, module, p.kind, whole, s)) is not None:
                mid.append((item[0], []) if any(path.startswith(sel) for sel in selectors) else item)
    if kv is not None and s.cp > 1:
        mid.append(_context_parallel(block, kv, s))
    return head + mid + tail


def takes_routing(block: nn.Module) -> bool:
    """Whether ``block`` is an experts module its layer hands the routing (Gemma 4's
    ``experts(hidden_states, top_k_index, top_k_weights)``): as a MoE region, it gathers them too."""
    names = list(inspect.signature(block.forward).parameters)[1:]
    return any("index" in n for n in names) and any("weight" in n for n in names)


def _block_ends(block: str, kinds: set[str], s: Sizes, routed: bool = False) -> tuple[list[Item], list[Item]]:
    """A block's entry and exit: the all-gather of its input (and of the routing a layer hands
    its experts: ``routed``) and, for a MoE region, the reduce-scatter of its output (a block run
    whole hands back a slice: its backward all-gathers)."""
    t, h, b = s.tokens, s.hidden, s.itemsize
    gather = _c("all_gather", "tp", f"{block}: hidden states in", t * h, b)
    head: list[Item] = []
    tail: list[Item] = []
    if kinds & {"gather_in", "colwise_gather_in", "moe"}:
        head.append(([gather], [_c("reduce_scatter", "tp", f"{block}: input gradient", t * h, b)]))
    if "moe" in kinds and routed:  # int64 expert indices; weights in fp32 (routers' softmax)
        rows = t * s.top_k
        fwd = [_c("all_gather", "tp", f"{block}: routing indices in", rows, 8)]
        fwd.append(_c("all_gather", "tp", f"{block}: routing weights in", rows, FP32))
        head.append((fwd, [_c("reduce_scatter", "tp", f"{block}: routing weights' gradient", rows, FP32)]))
    if "whole_block" in kinds:
        head.append(([gather], []))
        tail.append(([], [_c("all_gather", "tp", f"{block}: output gradient", t * h, b)]))
    if "moe" in kinds and s.ep > 1:
        head.append(_expert_parallel(block, s))
    if "moe" in kinds:
        out = _c("reduce_scatter", "tp", f"{block}: output to sequence shards", t * h, b)
        tail.append(([out], [_c("all_gather", "tp", f"{block}: output gradient", t * h, b)]))
    return head, tail


def _rowwise(path: str, module: nn.Module, gathered: bool, s: Sizes) -> Item:
    """A row-parallel projection: reduce-scatter out (backward: all-gather the output gradient,
    and the input gradient too when it took its slice of a whole input)."""
    t, b = s.tokens, s.itemsize
    out = _c("reduce_scatter", "tp", f"{path}: output to sequence shards", t * module.out_features, b)
    back = [_c("all_gather", "tp", f"{path}: output gradient", t * module.out_features, b)]
    if gathered:
        back.append(_c("all_gather", "tp", f"{path}: input gradient", t * module.in_features, b))
    return [out], back


def _all_reduced(path: str, module: nn.Module, s: Sizes) -> Item:
    """A row-parallel projection whose output is all-reduced whole, the layer adding the rank's rows
    of it (backward: the rows' gradients all-gathered)."""
    size = s.tokens * module.out_features
    return [_c("all_reduce", "tp", f"{path}: output", size, s.itemsize)], [
        _c("all_gather", "tp", f"{path}: output gradient", size, s.itemsize)
    ]


def _inside(path: str, module: nn.Module, kind: str, whole: bool, s: Sizes) -> Item | None:
    """A module inside a block with collectives of its own: a gathered column-parallel projection
    (its input gradient all-reduced when the block runs whole on plain tensors), a norm over a
    split width, learned activation scalars (each gradient all-reduced by DTensor on its own)."""
    t, b = s.tokens, s.itemsize
    if kind == "colwise_gathered":
        back = [_c("all_reduce", "tp", f"{path}: input gradient", t * module.in_features, b)] if whole else []
        return [_c("all_gather", "tp", f"{path}: output", t * module.out_features, b)], back
    if kind == "width_norm":
        width = sum(q.numel() for q in module.parameters(recurse=False))
        sums = _c("all_reduce", "tp", f"{path}: per-token sums", t, FP32)
        return [sums], [_c("reduce_scatter", "tp", f"{path}: input gradient", t * width, FP32)]
    if kind == "activation":
        params = [(n, q.numel()) for n, q in module.named_parameters(recurse=False) if q.requires_grad]
        return [], [_c("all_reduce", "tp", f"{path}: gradient of {n}", numel, b) for n, numel in params]
    return None


def _context_parallel(block: str, kv: tuple[int, int], s: Sizes) -> Item:
    """Keys and values of the whole sequence all-gathered over cp (backward: reduce-scattered)."""
    seq, b = s.tokens * s.cp, s.itemsize
    fwd = [_c("all_gather", "cp", f"{block}: keys", seq * kv[0], b)]
    fwd.append(_c("all_gather", "cp", f"{block}: values", seq * kv[1], b))
    bwd = [_c("reduce_scatter", "cp", f"{block}: value gradient", seq * kv[1], b)]
    bwd.append(_c("reduce_scatter", "cp", f"{block}: key gradient", seq * kv[0], b))
    return fwd, bwd


def _expert_parallel(block: str, s: Sizes) -> Item:
    """Tokens to the ranks that hold their experts and back (even routing: each rank sends
    tokens x top_k rows); the counts and expert ids go first."""
    rows = s.tokens * s.top_k
    fwd = [
        _c("all_to_all", "ep", f"{block}: rows per rank", s.ep, 8),
        _c("all_to_all", "ep", f"{block}: expert ids", rows, 8),
        _c("all_to_all", "ep", f"{block}: rows to their experts", rows * s.hidden, s.itemsize),
        _c("all_to_all", "ep", f"{block}: rows back", rows * s.hidden, s.itemsize),
    ]
    bwd = [
        _c("all_to_all", "ep", f"{block}: gradient of the rows back", rows * s.hidden, s.itemsize),
        _c("all_to_all", "ep", f"{block}: gradient of the rows", rows * s.hidden, s.itemsize),
    ]
    return fwd, bwd


def in_order(blocks: list[list[Item]]) -> tuple[list[Collective], list[Collective]]:
    """Forward: the blocks' steps in call order; backward: the same steps reversed."""
    items = [item for block in blocks for item in block]
    forward = [c for fwd, _ in items for c in fwd]
    backward = [c for _, bwd in reversed(items) for c in bwd]
    return forward, backward


def top_collectives(
    kinds: dict[str, tuple[str, int]], s: Sizes, partial_elements: int
) -> tuple[list[Collective], list[Collective]]:
    """Outside the layers (``kinds``: top-level path -> (part kind, its hidden width)): the embeddings' reduce-scatter,
    the lm_head's all-gather, loss parallel's three all-reduces; in the backward the mirror images
    and the one all-reduce of every partial gradient (:mod:`hf_tp.parallel.partial_grads`)."""
    t, b = s.tokens, s.itemsize
    fwd: list[Collective] = []
    bwd: list[Collective] = []
    for path, (kind, h) in kinds.items():
        if kind.startswith("embedding"):
            fwd.insert(0, _c("reduce_scatter", "tp", f"{path}: output to sequence shards", t * h, b))
            bwd.append(_c("all_gather", "tp", f"{path}: output gradient", t * h, b))
        elif kind == "positions":  # whole on every rank, sliced to shards: the gradient all-gathered back
            bwd.append(_c("all_gather", "tp", f"{path}: output gradient", t * s.hidden, b))
        elif kind.startswith("lm_head"):
            fwd.append(_c("all_gather", "tp", f"{path}: hidden states in", t * h, b))
            bwd.insert(0, _c("reduce_scatter", "tp", f"{path}: input gradient", t * h, b))
            if kind == "lm_head":
                fwd += [
                    _c("all_reduce", "tp", f"loss parallel: {w}", t, FP32)
                    for w in ("max", "sum of exp", "target logit")
                ]
    if s.cp > 1:
        fwd.append(_c("all_reduce", "cp", "loss summed over cp", 1, FP32))
    if partial_elements:
        bwd.append(
            _c("all_reduce", "tp", "partial gradients of replicated weights (one fused)", partial_elements, FP32)
        )
    return fwd, bwd


def keep(collectives: Iterable[Collective], sizes: dict[str, int]) -> tuple[Collective, ...]:
    """Drop the collectives over a dim of size 1 (they move nothing)."""
    return tuple(c for c in collectives if sizes.get(c.dim, 1) > 1)


def summary(collectives: Iterable[Collective], sizes: dict[str, int]) -> list[CommStat]:
    """Per (dim, collective): count, bytes and bytes one rank sends (``hf-tp estimate``'s record)."""
    totals: dict[tuple[str, str], list[int]] = {}
    for c in collectives:
        entry = totals.setdefault((c.dim, c.op), [0, 0])
        entry[0] += 1
        entry[1] += c.nbytes
    out = []
    for (dim, op), (count, nbytes) in sorted(totals.items()):
        n = sizes[dim]
        out.append(CommStat(dim, op, n, count, nbytes, int(nbytes * RING_FACTOR[op](n))))
    return out
