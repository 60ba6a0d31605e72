"""A :class:`hf_tp.plan.model_plan.ModelPlan` as the text ``hf-tp plan`` prints (and the snapshots hold)."""

from __future__ import annotations

from hf_tp.plan.collectives import summary
from hf_tp.plan.model_plan import Collective, LayerKind, ModelPlan, ModuleRow, ParamShard


def format_plan(plan: ModelPlan) -> str:
    """The plan as a readable report: header, one table per layer kind, the top level, totals."""
    dims = {"tp": plan.tp, "cp": plan.cp, "ep": plan.ep}
    layout = " x ".join(f"{d} {n}" for d, n in dims.items() if n > 1 or d == "tp")
    count = sum(len(k.layers) for k in plan.kinds)
    lines = [
        f"{plan.model} ({plan.model_type}): {layout}, {plan.batch_size} x {plan.seq_len} tokens, {plan.dtype}",
        f"adapter: {plan.adapter}",
    ]
    if plan.note:
        lines.append(f"hf_tp's notes on the family: {plan.note}")
    kinds = "1 kind" if len(plan.kinds) == 1 else f"{len(plan.kinds)} kinds"
    lines.append(f"decoder layers at {plan.layers_path}: {count}, {kinds}")
    for kind in plan.kinds:
        lines += ["", _kind_title(kind), *_table(kind.rows)]
        share = f"{100 * kind.split_share:.1f}%"
        lines.append(
            f"  tp splits {share} of this layer's weights: {kind.total:,} elements, {kind.per_rank:,} per rank"
        )
        lines += _collectives("forward, per layer", kind.forward, dims)
        lines += _collectives("backward, per layer", kind.backward, dims)
    lines += ["", "top level", *_table(plan.top)]
    lines += _collectives("forward", plan.top_forward, dims)
    lines += _collectives("backward", plan.top_backward, dims)
    lines += ["", *_totals(plan, dims)]
    if plan.notes:
        lines += ["", "notes:", *(f"  - {n}" for n in plan.notes)]
    return "\n".join(lines) + "\n"


def _kind_title(kind: LayerKind) -> str:
    label = f": {kind.label}" if kind.label else ""
    return f"layers {layer_ranges(kind.layers)} ({len(kind.layers)}){label}"


def layer_ranges(indices: tuple[int, ...]) -> str:
    """``0-31``, ``0, 2, 4`` or ``1-3, 5-7``: runs of consecutive indices; an even stride as ``0, 2, ..., 30``."""
    if len(indices) > 3:
        step = indices[1] - indices[0]
        if step > 1 and all(indices[i + 1] - indices[i] == step for i in range(len(indices) - 1)):
            return f"{indices[0]}, {indices[1]}, ..., {indices[-1]}"
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _table(rows: tuple[ModuleRow, ...]) -> list[str]:
    """Module, style, weights: full -> per rank; a row that runs whole says why underneath."""
    if not rows:
        return []
    w_path = max(len("module"), *(len(r.path) for r in rows))
    w_style = max(len("style"), *(len(r.style) for r in rows))
    out = [f"  {'module':<{w_path}}  {'style':<{w_style}}  weights: full -> per rank"]
    for r in rows:
        weights = ", ".join(_param(p) for p in r.params)
        out.append(f"  {r.path:<{w_path}}  {r.style:<{w_style}}  {weights}".rstrip())
        if r.whole:
            out.append(f"  {'':<{w_path}}    why whole: {r.whole}")
    return out


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _param(p: ParamShard) -> str:
    if not p.name:  # a passenger: its size
        return f"{p.shape[0]:,} parameters (whole)"
    if not p.placed:
        return f"{p.name} {_shape(p.shape)} (not placed)"
    if p.local == p.shape:
        return f"{p.name} {_shape(p.shape)} (whole)"
    packed = " (gate|up halves, each split)" if p.packed else ""
    return f"{p.name} {_shape(p.shape)} -> {_shape(p.local)}{packed}"


def size(nbytes: float) -> str:
    """Bytes in binary units: ``768 B``, ``3.0 KiB``, ``32.0 MiB``, ``1.50 GiB``."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit, scale in (("KiB", 1), ("MiB", 2), ("GiB", 3), ("TiB", 4)):
        value = nbytes / 1024**scale
        if value < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}" if unit in ("GiB", "TiB") else f"{value:.1f} {unit}"
    return ""


def _collectives(title: str, items: tuple[Collective, ...], dims: dict[str, int]) -> list[str]:
    if not items:
        return [f"  {title}: no collectives"]
    stats = summary(items, dims)
    total = sum(s.bytes for s in stats)
    sent = sum(s.sent_bytes for s in stats)
    several = len({s.dim for s in stats}) > 1
    counts = ", ".join(
        f"{s.count} {s.collective.replace('_', '-')}" + (f" ({s.dim})" if several else "") for s in stats
    )
    out = [f"  {title}: {counts} ({size(total)}; one rank sends {size(sent)})"]
    w_where = max(len(c.where) for c in items)
    for c in items:
        out.append(f"    {c.op.replace('_', '-'):<14}  {c.dim}  {c.where:<{w_where}}  {size(c.nbytes):>10}")
    return out


def _totals(plan: ModelPlan, dims: dict[str, int]) -> list[str]:
    """One forward + backward of the whole model, per mesh dim and collective."""
    every: list[Collective] = [*plan.top_forward, *plan.top_backward]
    for kind in plan.kinds:
        every += [*kind.forward, *kind.backward] * len(kind.layers)
    if not every:
        return ["one forward + backward: no collectives"]
    out = ["one forward + backward, whole model:"]
    for s in summary(every, dims):
        out.append(
            f"  {s.dim} {s.collective.replace('_', '-'):<14} {s.count:>5} x, {size(s.bytes):>10}; "
            f"one rank sends {size(s.sent_bytes)}"
        )
    return out
