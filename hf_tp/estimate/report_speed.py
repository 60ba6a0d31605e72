"""Plain-text tables of predicted speed: one layout's breakdown, and a sweep's ranking."""

from __future__ import annotations

from hf_tp.estimate.api import Estimate, GiB
from hf_tp.estimate.layouts import Sweep, headroom
from hf_tp.estimate.speed import Cluster, Speed
from hf_tp.estimate.sweep_speed import layout_name

_PARTS = {"matmul": "matmuls", "attention": "attention (flash, causal)", "memory": "memory-bound kernels"}
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


def _why(est: Estimate, speed: Speed, gpu_memory: int) -> str:
    exposed = {p.split()[0]: s / speed.step_seconds for p, s in speed.seconds.items() if p.endswith("exposed") and s}
    comm = ", ".join(f"{dim} {share:.0%}" for dim, share in sorted(exposed.items(), key=lambda kv: -kv[1]))
    ac = ", recomputes each layer" if est.activation_checkpointing else ""
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
    header = f"{'#':>3}{'tp':>4}" + (f"{'cp':>4}" if cp else "") + f"{'dp':>5}{'batch':>6}{'AC':>4}"
    header += f"{'tok/s/GPU':>11}{'MFU':>7}{'step ms':>9}{'compute':>9}{'TP exp':>8}"
    header += (f"{'CP exp':>8}" if cp else "") + f"{'DP exp':>8}{'EP exp':>8}{'peak GiB':>10}{'headroom':>10}"
    lines.append(header)
    for i, (e, s) in enumerate(ranked, 1):
        exp = {d: s.seconds.get(f"{d} exposed", 0.0) * 1e3 for d in ("tp", "cp", "dp", "ep")}
        exp["dp"] += s.seconds.get("dp_out exposed", 0.0) * 1e3
        row = f"{i:>3}{e.tp:>4}" + (f"{e.cp:>4}" if cp else "") + f"{e.dp:>5}{e.batch_size:>6}"
        row += f"{'yes' if e.activation_checkpointing else 'no':>4}"
        row += f"{s.tokens_per_second_per_gpu:>11,.0f}{s.mfu:>7.1%}{s.step_seconds * 1e3:>9.0f}"
        row += f"{s.compute_seconds * 1e3:>9.0f}{exp['tp']:>8.0f}" + (f"{exp['cp']:>8.0f}" if cp else "")
        row += f"{exp['dp']:>8.0f}{exp['ep']:>8.0f}{e.peak.total / GiB:>10.1f}{headroom(e, gpu):>10.1f}"
        lines.append(row)
    lines.append(
        "(ms per step; batch = sequences per dp rank; exp = collectives on the critical path; "
        "headroom = GPU memory left after the margins)"
    )
    for i, (e, s) in enumerate(ranked[:TOP], 1):
        lines.append(f"  #{i} {layout_name(e)}, batch {e.batch_size}: {_why(e, s, gpu)}")
    lines += [f"  not simulated: {note}" for note in result.skipped]
    best, speed = ranked[0]
    ac = " --activation-checkpointing" if best.activation_checkpointing else ""
    lines.append(
        f"Fastest that fits: --tp {best.tp}{f' --cp {best.cp}' if cp else ''} --dp {best.dp} --batch-size "
        f"{best.batch_size}{ac}: {speed.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, MFU {speed.mfu:.1%}, "
        f"step {speed.step_seconds:.2f} s."
    )
    lines.append("assumptions:")
    lines += footnotes(speed)
    return "\n".join(lines)
