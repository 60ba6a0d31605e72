"""Plain-text tables of predicted speed: one layout's step time and its parts, a sweep's ranking by
tokens/s per GPU (pipeline and HSDP columns where the sweep has such layouts)."""

from __future__ import annotations

from hf_tp.estimate.api import Estimate
from hf_tp.estimate.candidates import layout_of
from hf_tp.estimate.spec import GiB
from hf_tp.estimate.speed import BUBBLE, Cluster, Speed
from hf_tp.estimate.sweep import Sweep, headroom, layout_name


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
        lines.append(f"  #{i} {layout_name(e)}, batch {e.batch_size}: {_why(e, s, gpu)}")
    lines += [f"  not simulated: {note}" for note in result.skipped]
    best, speed = ranked[0]
    lines.append(
        f"Fastest that fits: {train_flags(best)}: {speed.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, "
        f"MFU {speed.mfu:.1%}, step {speed.step_seconds:.2f} s."
    )
    lines.append("assumptions:")
    lines += footnotes(speed)
    return "\n".join(lines)
