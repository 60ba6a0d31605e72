"""What ``hf-tp estimate`` prints: plain-text tables of an estimate's memory and collectives, of a
sweep's splits, of one layout's predicted step time and its parts, and of a sweep's ranking by
tokens/s per GPU (pipeline and HSDP columns where the sweep has such layouts).
"""

from __future__ import annotations

from hf_tp.estimate.estimate_run import Estimate
from hf_tp.estimate.memory import BALANCED_NOTE_LINES
from hf_tp.estimate.spec import GiB, MiB
from hf_tp.estimate.speed import BUBBLE, Cluster, Speed
from hf_tp.estimate.sweep import RANK_RULE, RULE, Sweep, describe_layout, fits, headroom, layout_of

_CATEGORIES = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer", "optimizer state"),
    ("activations", "activations"),
    ("temporary", "temporary (backward)"),
    ("other", "other (buffers)"),
)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def describe_model(est: Estimate) -> str:
    if est.tower_params or est.projector_params:  # a multimodal wrapper
        return (
            f"{est.model} ({est.model_type}, {_params(est.num_params)} params: vision tower "
            f"{_params(est.tower_params)} frozen, projector {_params(est.projector_params)} "
            f"{'frozen (LoRA on the language model)' if est.lora_r else 'trained'})"
        )
    return f"{est.model} ({est.model_type}, {_params(est.num_params)} params)"


def describe(est: Estimate) -> str:
    """One line naming the model and the run shape."""
    ac = "activation checkpointing" if est.activation_checkpointing else "no activation checkpointing"
    ep = f", ep={est.ep} (of dp's ranks)" if est.ep > 1 else ""
    if est.dp_replicate > 1:
        ep += f", HSDP: {est.dp_replicate} replicas x {est.dp // est.dp_replicate} ranks sharding the state"
    if est.pp > 1:
        v = f" x {est.pp_virtual_stages} stages per rank" if est.pp_virtual_stages > 1 else ""
        ep += (
            f", pp={est.pp}{v} ({est.pp_schedule}, {est.microbatches} micro-batches; the busiest rank: "
            f"{est.stage_layers} decoder layers, {est.in_flight:g} micro-batches in flight)"
        )
    lora = ""
    if est.lora_r:
        lora = (
            f", LoRA r={est.lora_r} on {est.lora_target_modules} ({_params(est.trainable_params)} trainable; "
            f"frozen base in {est.dtype})"
        )
    pp = f"pp={est.pp} x " if est.pp > 1 else ""
    return (
        f"{describe_model(est)}, {pp}tp={est.tp}{f' x cp={est.cp}' if est.cp > 1 else ''} x dp={est.dp} "
        f"({est.world_size} ranks){ep}, seq {est.seq_len} x batch {est.batch_size} per dp rank, {est.dtype}, {ac}"
        f"{lora}"
    )


def format_images(est: Estimate) -> list[str]:
    """A wrapper's paragraph: its weights as counted, and what ``--images-per-row`` images add."""
    lines = [
        "",
        "Multimodal wrapper: the vision tower's and projector's weights are counted (replicated over tp,",
        "sharded over dp; the frozen tower without gradients or optimizer state); the simulated step is text-only.",
    ]
    im = est.images
    if im is None:
        return [*lines, "Image activations: give --images-per-row (and --image-size) to count them."]
    gather = est.tower_params * (2 if est.dtype == "bf16" else 4)
    return [
        *lines,
        f"Images, counted from the config: {im.images_per_row} per row at {im.image_size}x{im.image_size}, "
        f"{im.tower_tokens} tower tokens and {im.merged_tokens} merged tokens each",
        f"  projector's saved activations           {_mib(im.projector_saved):>12} MiB",
        f"  merged sequence (its copy; whole on tp) {_mib(im.merged_sequence):>12} MiB",
        f"  peak with images (the two above added)  {_mib(est.peak.total + im.peak_extra):>12} MiB",
        f"  frozen tower's working set (transient, at the forward's start) {_mib(im.tower_working_set):>10} MiB",
        f"  tower gathered whole over dp (transient, at the forward's start) {_mib(gather if est.dp > 1 else 0):>9} MiB",
    ]


def format_estimate(est: Estimate) -> str:
    """The memory table (peak and between steps) and the collectives table of one estimate."""
    lines = [f"hf-tp estimate: {describe(est)}", ""]
    lines.append(f"{'memory per rank':<24}{'at peak MiB':>14}{'GiB':>9}{'after step MiB':>17}")
    for key, label in _CATEGORIES:
        peak, state = getattr(est.peak, key), getattr(est.state, key)
        lines.append(f"  {label:<22}{_mib(peak):>14}{peak / GiB:>9.2f}{_mib(state):>17}")
    lines.append(f"  {'total':<22}{_mib(est.peak.total):>14}{est.peak.total / GiB:>9.2f}{_mib(est.state.total):>17}")
    lines.append("")
    if est.comms:
        lines.append(f"{'collectives per step':<24}{'ranks':>6}{'count':>7}{'tensor MiB':>13}{'sent/rank MiB':>15}")
        for c in est.comms:
            label = f"{c.dim} {c.collective}"
            lines.append(f"  {label:<22}{c.group_size:>6}{c.count:>7}{_mib(c.bytes):>13}{_mib(c.sent_bytes):>15}")
        for dim in sorted({c.dim for c in est.comms}):
            lines.append(f"  {dim + ' total sent per rank':<48}{_mib(est.sent_bytes(dim)):>15}")
    else:
        lines.append("collectives per step: none (a single rank)")
    lines += format_moe(est)
    if est.pp > 1:
        lines += [
            "",
            f"Pipeline: one rank of the busiest stage over the whole step ({est.microbatches} micro-batches of "
            f"{est.batch_size // est.microbatches} row(s)): simulated with its {est.stage_layers} decoder layers, the",
            "embedding and the lm_head (a bound: each sits on one stage only), one micro-batch; the peak adds the "
            f"saved activations of {est.in_flight:g} micro-batches in flight in all ({est.pp_schedule}, the first rank's count)",
            "or the last stage's loss on a micro-batch's whole logits, or the stage's unsharded gradients held from",
            "its first backward to the step's end, whichever is largest; collectives and work per step: each",
            "micro-batch's, times the micro-batches (the optimizer and FSDP2's reduce-scatter once).",
        ]
    if est.tower_params or est.projector_params:
        lines += format_images(est)
    lines += [
        "",
        "Peak: the largest sum of live tensors on one rank during a step (forward, backward, clipping, AdamW),",
        "with FSDP-unsharded parameters counted as parameters. 'after step': the sharded state kept between",
        "steps (gradients are freed by zero_grad). Not included: CUDA context, NCCL buffers, allocator",
        "fragmentation (leave 1-2 GiB and ~10%). sent/rank: bytes one rank sends with ring algorithms.",
        f"Simulated in {est.seconds:.1f} s on CPU with a fake process group and fake tensors (no weights, no GPU)"
        + (f"; {extended(est)}." if est.extended_from else "."),
    ]
    return "\n".join(lines)


def extended(est: Estimate) -> str:
    """How a fast estimate was made (``est.extended_from``: the layer counts simulated)."""
    lo, hi, *checked = est.extended_from
    at = f", checked exact against a run of {checked[0]} layers" if checked else ""
    return (
        f"the model cut to {lo} and {hi} decoder layers, extended to its depth{at} (hf-tp estimate --full: every layer)"
    )


def format_moe(est: Estimate) -> list[str]:
    """The mixture-of-experts section (empty for a dense model), after a blank line."""
    m = est.moe
    if m is None:
        return []
    rows = "(token, choice) rows per MoE layer and micro-step"
    if est.ep > 1:
        rows += f" ({m.a2a_rows_out:,} out, {m.a2a_rows_in:,} in by all-to-all)"
    lines = [
        "",
        f"mixture of experts: {m.layers} MoE layers, {m.experts} experts each, top-{m.top_k}",
        f"  {'experts per rank':<22}{m.experts_per_rank:>14}   per MoE layer (ep={est.ep})",
        f"  {'expert weights MiB':<22}{_mib(m.expert_param_bytes):>14}   this rank's fp32 shards, all MoE layers "
        f"(other weights: {_mib(m.other_param_bytes)} MiB)",
        f"  {'routed rows':<22}{m.routed_rows:>14,}   {rows}",
        f"  {'routed activations MiB':<22}{_mib(m.activation_bytes):>14}   kept for backward by the experts' "
        "forwards, all MoE layers",
        f"  {'experts forward MiB':<22}{_mib(m.forward_peak_bytes):>14}   the most one experts forward holds "
        "above its start",
    ]
    if m.balanced_routing:
        lines += [f"  {line}" for line in BALANCED_NOTE_LINES]
    return lines


def format_sweep(result: Sweep, wall_seconds: float | None = None) -> str:
    """One row per (tp, dp) split, the recommendation and the rule behind it; ``wall_seconds``: how
    long the sweep took (its simulations' own seconds add up over parallel workers)."""
    first = result.estimates[0]
    gpu = result.gpu_memory
    cp = f"cp={result.cp} fixed, " if result.cp > 1 else ""
    lines = [f"hf-tp estimate: every (tp, dp) split of {result.world_size} ranks for {describe_model(first)}"]
    lines.append(
        cp
        + (f"ep={result.ep} (of dp's ranks), " if result.ep > 1 else "")
        + (f"LoRA r={first.lora_r} on {first.lora_target_modules}, " if first.lora_r else "")
        + f"seq {first.seq_len} x batch {first.batch_size} per dp rank, {first.dtype}, "
        f"{'with' if first.activation_checkpointing else 'no'} activation checkpointing"
        + (f"; GPU memory {gpu / GiB:.1f} GiB" if gpu else "")
    )
    lines.append("")
    pp_col, hsdp_col = _layout_columns(result.estimates)
    header = _layout_header(pp_col, hsdp_col) + f"{'tp':>4}{'dp':>5}{'batch':>6}{'peak GiB':>10}{'params':>9}"
    header += f"{'grads':>8}{'optim':>8}{'activ':>8}{'temp':>8}{'TP sent/step GiB':>18}{'DP sent/step GiB':>18}"
    header += f"{'CP sent/step GiB':>18}" if result.cp > 1 else ""
    header += f"{'EP sent/step GiB':>18}" if result.ep > 1 else ""
    header += f"{'fits':>6}" if gpu else ""
    lines.append(header)
    for e in result.estimates:
        p = e.peak
        row = _layout_cells(e, pp_col, hsdp_col) + f"{e.tp:>4}{e.dp:>5}{e.batch_size:>6}{p.total / GiB:>10.2f}"
        row += f"{p.parameters / GiB:>9.2f}{p.gradients / GiB:>8.2f}{p.optimizer / GiB:>8.2f}{p.activations / GiB:>8.2f}{(p.temporary + p.other) / GiB:>8.2f}"
        dp_sent = sum(e.sent_bytes(d) for d in ("dp", "dp_out", "dp_replicate", "dp_all"))
        row += f"{e.sent_bytes('tp') / GiB:>18.2f}{dp_sent / GiB:>18.2f}"
        row += f"{e.sent_bytes('cp') / GiB:>18.2f}" if result.cp > 1 else ""
        row += f"{e.sent_bytes('ep') / GiB:>18.2f}" if result.ep > 1 else ""
        if gpu:
            row += f"{'yes' if fits(e, gpu) else 'no':>6}"
        if e.activation_checkpointing != first.activation_checkpointing:
            row += "  with activation checkpointing"
        if result.recommended is e:
            row += "  <- recommended"
        lines.append(row)
    lines.append("(memory columns: GiB per rank at the step's peak; sent: bytes one rank sends per step)")
    if result.cp > 1:
        lines.append(
            f"cp={result.cp}: DP sent is FSDP2's traffic over dp x cp ranks; CP sent the K/V all-gathers and "
            "dK/dV reduce-scatters of attention."
        )
    if result.ep > 1:
        lines += [
            *BALANCED_NOTE_LINES,
            f"DP sent includes the expert gradients' all-reduce over dp / ep; splits whose dp is not a multiple "
            f"of ep={result.ep} are left out.",
        ]
    lines.append("")
    if gpu is None:
        lines.append("Pass --gpu-memory (e.g. 80GiB) to get a recommendation.")
    elif result.recommended is not None:
        r = result.recommended
        ac = " --activation-checkpointing" if r.activation_checkpointing else ""
        lines.append(
            f"Recommended: --tp {r.tp}{f' --cp {r.cp}' if r.cp > 1 else ''} --dp {r.dp} --batch-size {r.batch_size}{ac} "
            f"(peak {r.peak.total / GiB:.2f} GiB per rank)."
        )
    else:
        lines.append(
            f"No split of {result.world_size} ranks fits {gpu / GiB:.1f} GiB: try --activation-checkpointing, "
            "a smaller --batch-size or --seq-len, --dtype bf16, or more GPUs (--world-size)."
        )
    lines.append(RANK_RULE if result.cluster else RULE)
    lines.append("--batch-size is per dp rank: keep the global batch across splits with hf-tp train --grad-accum.")
    took = wall_seconds if wall_seconds is not None else sum(e.seconds for e in result.estimates)
    lines.append(f"Simulated in {took:.1f} s on CPU (fake process group).")
    return "\n".join(lines + _depths(result))


def _depths(result: Sweep) -> list[str]:
    """How many layouts were estimated from short runs (none: every layout at every layer)."""
    short = [e for e in result.estimates if e.extended_from]
    if not short:
        return []
    best = result.recommended
    whole = "; the recommended one at every layer" if best is not None and not best.extended_from else ""
    if best is not None and len(best.extended_from) == 3:
        whole = f"; the recommended one checked: its extension predicts a run of {best.extended_from[2]} layers exactly"
    lo, hi = short[0].extended_from[:2]
    return [
        f"{len(short)} of {len(result.estimates)} layouts from the model cut to {lo} and {hi} decoder layers, "
        f"extended to its depth (--full: every layer){whole}."
    ]


__all__ = [
    "describe",
    "describe_model",
    "format_estimate",
    "format_moe",
    "format_ranking",
    "format_speed",
    "format_sweep",
]


def _layout_columns(ests) -> tuple[bool, bool]:
    """Whether any of ``ests`` is a pipeline layout, and whether any is HSDP (their columns shown)."""
    return any(e.pp > 1 for e in ests), any(e.dp_replicate > 1 for e in ests)


def _layout_cells(e: Estimate, pp: bool, hsdp: bool) -> str:
    cells = ""
    if pp:
        sched = {"1f1b": "1F1B", "interleaved1f1b": "I1F1B", "gpipe": "GPipe", "loopedbfs": "BFS"}[e.pp_schedule]
        cells += f"{e.pp:>4}{(sched if e.pp > 1 else '-'):>7}{(e.microbatches if e.pp > 1 else '-'):>5}"
    if hsdp:
        cells += f"{(e.dp_replicate if e.dp_replicate > 1 else '-'):>5}"
    return cells


def _layout_header(pp: bool, hsdp: bool) -> str:
    return (f"{'pp':>4}{'sched':>7}{'M':>5}" if pp else "") + (f"{'repl':>5}" if hsdp else "")


_PARTS = {
    "matmul": "matmuls",
    "attention": "attention (flash, causal)",
    "memory": "memory-bound kernels",
    BUBBLE: "pipeline bubble (idle)",
}
TOP = 5


def _label(part: str, est: Estimate) -> str:
    if part == "attention" and est.cp > 1:
        return "attention (masked, every score)"
    if part in _PARTS:
        return _PARTS[part]
    dim = part.split()[0]
    return f"{dim} collectives exposed"


def describe_cluster(cluster: Cluster, world_size: int) -> str:
    g = cluster.gpu
    nodes = max(1, -(-world_size // g.gpus_per_node))
    return f"{world_size} x {g.name} ({nodes} node(s) of {g.gpus_per_node}, {cluster.inter_node_gbps:g} Gb/s per GPU across)"


def footnotes(speed: Speed) -> list[str]:
    return [f"  [{i}] {line}" for i, line in enumerate(speed.assumptions, 1)]


def format_speed(est: Estimate, speed: Speed, cluster: Cluster) -> str:
    """One layout's predicted step time, its parts, tokens/s per GPU and MFU, with the footnote."""
    lines = [f"predicted speed on {describe_cluster(cluster, est.world_size)}:"]
    lines.append(f"  {'step time':<34}{speed.step_seconds * 1e3:>10.1f} ms")
    for part, seconds in speed.seconds.items():
        share = seconds / speed.step_seconds if speed.step_seconds else 0.0
        extra = ""
        if part.endswith("exposed"):
            dim = part.split()[0]
            extra = f"   (all {dim} collectives: {speed.comm.get(dim, 0.0) * 1e3:.1f} ms)"
        lines.append(f"    {_label(part, est):<32}{seconds * 1e3:>10.1f} ms {share:>6.1%}{extra}")
    lines.append(f"  {'tokens/s per GPU':<34}{speed.tokens_per_second_per_gpu:>10,.0f}")
    lines.append(f"  {'MFU':<34}{speed.mfu:>10.1%}")
    lines.append(f"  {'exposed communication':<34}{speed.exposed_comm_share:>10.1%} of the step")
    lines.append("assumptions:")
    lines += footnotes(speed)
    return "\n".join(lines)


def train_flags(est: Estimate) -> str:
    """The ``hf-tp train`` flags of ``est``'s layout (``--pp ... --tp 8 --dp 4 --batch-size 2``)."""
    lay = layout_of(est)
    out = ""
    if lay.pp > 1:
        out += f"--pp {lay.pp} --pp-schedule {lay.pp_schedule} --microbatches {lay.microbatches} "
        out += f"--pp-virtual-stages {lay.pp_virtual_stages} " if lay.pp_virtual_stages > 1 else ""
    out += f"--tp {lay.tp}{f' --cp {est.cp}' if est.cp > 1 else ''} --dp {lay.dp} "
    out += f"--dp-replicate {lay.dp_replicate} " if lay.dp_replicate > 1 else ""
    return (
        out + f"--batch-size {est.batch_size}" + (" --activation-checkpointing" if est.activation_checkpointing else "")
    )


def _why(est: Estimate, speed: Speed, gpu_memory: int) -> str:
    exposed = {p.split()[0]: s / speed.step_seconds for p, s in speed.seconds.items() if p.endswith("exposed") and s}
    comm = ", ".join(f"{dim} {share:.0%}" for dim, share in sorted(exposed.items(), key=lambda kv: -kv[1]))
    ac = ", recomputes each layer" if est.activation_checkpointing else ""
    ac += f", idles {speed.bubble_share:.0%} in the pipeline bubble" if est.pp > 1 else ""
    return (
        f"{headroom(est, gpu_memory):.1f} GiB headroom{ac}; {speed.exposed_comm_share:.0%} of the step waits on "
        f"communication{' (' + comm + ')' if comm else ''}; compute {speed.compute_seconds * 1e3:.0f} ms"
    )


def format_ranking(result: Sweep) -> str:
    """The layouts that fit, fastest first (the top few with why), and the footnote."""
    ranked = result.ranking()
    cluster, gpu = result.cluster, result.gpu_memory
    if cluster is None or gpu is None:
        return ""
    lines = [
        f"ranked by predicted tokens/s per GPU on {describe_cluster(cluster, result.world_size)}, "
        f"{gpu / GiB:.1f} GiB each:"
    ]
    if not ranked:
        return "\n".join(lines + ["  no layout fits (see above)"])
    cp = result.cp > 1
    pp, hsdp = _layout_columns([e for e, _ in ranked])
    header = f"{'#':>3}" + _layout_header(pp, hsdp) + f"{'tp':>4}" + (f"{'cp':>4}" if cp else "")
    header += f"{'dp':>5}{'batch':>6}{'AC':>4}{'tok/s/GPU':>11}{'MFU':>7}{'step ms':>9}{'compute':>9}{'TP exp':>8}"
    header += (f"{'CP exp':>8}" if cp else "") + f"{'DP exp':>8}{'EP exp':>8}"
    header += (f"{'PP exp':>8}{'bubble':>8}" if pp else "") + f"{'peak GiB':>10}{'headroom':>10}"
    lines.append(header)
    for i, (e, s) in enumerate(ranked, 1):
        exp = {d: s.seconds.get(f"{d} exposed", 0.0) * 1e3 for d in ("tp", "cp", "dp", "ep", "pp")}
        exp["dp"] += sum(s.seconds.get(f"{d} exposed", 0.0) * 1e3 for d in ("dp_out", "dp_replicate", "dp_all"))
        row = f"{i:>3}" + _layout_cells(e, pp, hsdp) + f"{e.tp:>4}" + (f"{e.cp:>4}" if cp else "")
        row += f"{e.dp:>5}{e.batch_size:>6}{'yes' if e.activation_checkpointing else 'no':>4}"
        row += f"{s.tokens_per_second_per_gpu:>11,.0f}{s.mfu:>7.1%}{s.step_seconds * 1e3:>9.0f}"
        row += f"{s.compute_seconds * 1e3:>9.0f}{exp['tp']:>8.0f}" + (f"{exp['cp']:>8.0f}" if cp else "")
        row += f"{exp['dp']:>8.0f}{exp['ep']:>8.0f}"
        row += f"{exp['pp']:>8.0f}{s.seconds.get('pp bubble', 0.0) * 1e3:>8.0f}" if pp else ""
        row += f"{e.peak.total / GiB:>10.1f}{headroom(e, gpu):>10.1f}"
        lines.append(row)
    lines.append(
        "(ms per step; batch = sequences per dp rank; exp = collectives on the critical path; "
        "headroom = GPU memory left after the margins)"
    )
    for i, (e, s) in enumerate(ranked[:TOP], 1):
        lines.append(f"  #{i} {describe_layout(e)}, batch {e.batch_size}: {_why(e, s, gpu)}")
    lines += [f"  not simulated: {note}" for note in result.skipped]
    best, speed = ranked[0]
    lines.append(
        f"Fastest that fits: {train_flags(best)}: {speed.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, "
        f"MFU {speed.mfu:.1%}, step {speed.step_seconds:.2f} s."
    )
    lines.append("assumptions:")
    lines += footnotes(speed)
    return "\n".join(lines)
