"""Step time, tokens/s per GPU and MFU of an estimated training step on a named GPU cluster.

An analytical model over what the traced step counted (:class:`hf_tp.estimate.counters.Work`, the
collectives of :class:`hf_tp.estimate.counters.CommStat`):

- compute = matmul FLOPs / (peak x matmul efficiency) + attention FLOPs x 1/2 (causal; all of
  them under cp, whose masked kernel computes every score) / (peak x attention efficiency) +
  other kernels' bytes / (HBM bandwidth x its efficiency);
- a collective = calls x NCCL's ring latency + bytes one rank sends / the bandwidth of the
  slowest link its ring crosses (a group that spans nodes with ``k`` members per node uses ``k``
  NICs); an all-to-all sends its cross-node share over the NICs and the rest over the node's link;
- MFU: :func:`hf_tp.gpus.model_flops_per_token` (6N + 12 L H S, training's definition) x tokens/s
  per GPU / the GPU's peak, so an estimate's MFU and a run's metrics.jsonl ``mfu`` compare;
- exposed: tensor-parallel, context-parallel, expert-parallel and norm collectives sit on the
  critical path; FSDP's
  (dp) all-gathers and reduce-scatters (and HSDP's all-reduce across replicas) hide behind compute
  except the first all-gather and the last reduction, and except what all of them together take
  beyond the compute itself;
- pipeline parallelism (``pp`` > 1, the busiest rank's whole step: :mod:`hf_tp.estimate.layouts`):
  each micro-batch's boundary send and receive is exposed (over the network when a stage's ranks
  fill a node or more: pp is the outermost mesh dim), and the rank idles for the bubble, ``(pp - 1)
  / (V x M)`` of its busy time (compute and exposed tp/cp/ep/pp collectives): a bubble of ``(pp -
  1) / (V x M + pp - 1)`` of the step (V = 1 for 1F1B and GPipe).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hf_tp.estimate.counters import CommStat
from hf_tp.estimate.estimate_run import Estimate
from hf_tp.estimate.layouts import bubble_fraction
from hf_tp.gpus import DEFAULT_INTER_NODE_GBPS, GPU, NET_EFFICIENCY, mfu

# NCCL's own cost model (src/graph/tuning.cc), ring algorithm, Simple protocol (large messages):
# a base latency per call and a latency per ring step on each kind of hop, in seconds.
BASE_LATENCY = 8.4e-6
STEP_LATENCY = {"NVLink": 3.4e-6, "PCIe": 5.7e-6, "net": 14e-6}
CAUSAL_FRACTION = 0.5  # a causal flash kernel skips the masked half of the score matrix
# FSDP2's collectives run on their own stream, prefetched (HSDP's all-reduce across replicas too)
OVERLAPPED_DIMS = ("dp", "dp_out", "dp_replicate")
COMPUTE_PARTS = ("matmul", "attention", "memory")
BUBBLE = "pp bubble"  # the part of a pipeline step a rank waits idle


@dataclass(frozen=True)
class Cluster:
    """GPUs of one kind, ``gpu.gpus_per_node`` to a node, ``inter_node_gbps`` of network per GPU."""

    gpu: GPU
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS

    def __post_init__(self) -> None:
        if not self.inter_node_gbps > 0:
            raise ValueError(f"--inter-node-gbps must be positive, got {self.inter_node_gbps!r}")

    @property
    def net_bandwidth(self) -> float:
        """Bytes/s one GPU's NIC moves in one direction, at NCCL's efficiency."""
        return self.inter_node_gbps * 1e9 / 8 * NET_EFFICIENCY

    @property
    def link_bandwidth(self) -> float:
        return self.gpu.link_bandwidth * self.gpu.link_efficiency


def dim_stride(dim: str, tp: int, ep: int, dp_shard: int = 1, stage: int = 1) -> int:
    """Rank distance between neighbours of a mesh dim: the (dp_out, ep, tp) / (dp, tp) / (dp, cp,
    tp) / (dp_replicate, dp_shard, tp) meshes keep tp innermost, so tp groups are consecutive
    ranks and dp's (FSDP2's dp x cp with cp, its shard group with HSDP), ep's and cp's are tp
    apart; HSDP's replicas are tp x dp_shard apart (across nodes once a replica fills one);
    pipeline stages (pp, outermost) a stage's ``stage`` ranks apart."""
    strides = {
        "tp": 1, "cp": tp, "dp": tp, "dp_all": tp, "ep": tp, "dp_out": tp * ep, "dp_replicate": tp * dp_shard,
        "pp": stage,
    }  # fmt: skip
    return strides.get(dim, 1)


def members_per_node(group_size: int, stride: int, gpus_per_node: int) -> int:
    """How many of a group's ranks share a node (ranks fill nodes in order)."""
    if group_size * stride <= gpus_per_node:
        return group_size
    return max(1, min(group_size, gpus_per_node // stride))


def collective_seconds(stat: CommStat, per_node: int, cluster: Cluster) -> float:
    """Time of all of ``stat``'s calls on one rank (see the module docstring)."""
    n, hop = stat.group_size, cluster.gpu.link
    nodes = n // per_node
    steps = 2 * (n - 1) if stat.collective == "all_reduce" else n - 1
    inter_steps = 0 if nodes == 1 else (2 if stat.collective == "all_reduce" else 1) * (nodes - 1)
    latency = BASE_LATENCY + (steps - inter_steps) * STEP_LATENCY[hop.split()[0]] + inter_steps * STEP_LATENCY["net"]
    if stat.collective == "send_recv":  # point to point, to the next stage's rank (or from it)
        latency = BASE_LATENCY + STEP_LATENCY["net" if nodes > 1 else hop.split()[0]]
        transfer = stat.sent_bytes / (cluster.net_bandwidth if nodes > 1 else cluster.link_bandwidth)
    elif stat.collective == "all_to_all":
        latency = BASE_LATENCY + STEP_LATENCY["net" if nodes > 1 else hop.split()[0]]
        cross = stat.sent_bytes * (n - per_node) / (n - 1)
        transfer = max((stat.sent_bytes - cross) / cluster.link_bandwidth, cross / cluster.net_bandwidth)
    else:
        bandwidth = (
            cluster.link_bandwidth if nodes == 1 else min(cluster.link_bandwidth, per_node * cluster.net_bandwidth)
        )
        transfer = stat.sent_bytes / bandwidth
    return stat.count * latency + transfer


@dataclass(frozen=True)
class Speed:
    """Predicted time of one training step on one rank, its parts, and the rates that follow.

    ``seconds`` maps each part to its time: ``matmul``, ``attention``, ``memory`` (compute) and
    ``<dim> exposed`` (communication on the critical path); ``comm`` holds each mesh dim's full
    collective time, hidden or not.
    """

    gpu: str
    step_seconds: float
    seconds: dict[str, float]
    comm: dict[str, float]
    tokens_per_second_per_gpu: float
    mfu: float
    assumptions: list[str] = field(default_factory=list)

    @property
    def compute_seconds(self) -> float:
        return sum(v for k, v in self.seconds.items() if k in COMPUTE_PARTS)

    @property
    def exposed_comm_share(self) -> float:
        """Fraction of the step spent waiting on communication."""
        exposed = sum(v for k, v in self.seconds.items() if k.endswith("exposed"))
        return exposed / self.step_seconds if self.step_seconds else 0.0

    @property
    def bubble_share(self) -> float:
        """Fraction of the step a pipeline rank waits idle (0 without pp)."""
        return self.seconds.get(BUBBLE, 0.0) / self.step_seconds if self.step_seconds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "compute_seconds": self.compute_seconds, "exposed_comm_share": self.exposed_comm_share}


def compute_seconds(est: Estimate, gpu: GPU) -> dict[str, float]:
    """Matmul, attention and memory-bound kernel time of the traced step on ``gpu``."""
    work = est.work
    if work is None:
        raise ValueError("this estimate has no work counts; run it with hf_tp.estimate.estimate")
    peak = gpu.peak_flops(est.dtype)
    return {
        "matmul": work.matmul_flops / (peak * gpu.matmul_efficiency),
        "attention": work.attention_flops * attention_fraction(est) / (peak * gpu.attention_efficiency),
        "memory": work.memory_bytes / (gpu.hbm_bandwidth * gpu.hbm_efficiency),
    }


def attention_fraction(est: Estimate) -> float:
    """The share of the counted (full) score matrix the attention kernel computes: half with a
    causal flash kernel; all of it under cp, where SDPA gets a boolean mask of global positions
    and runs a kernel that skips no masked block."""
    return CAUSAL_FRACTION if est.cp == 1 else 1.0


def tokens_per_gpu(est: Estimate) -> float:
    """Tokens one GPU processes per step: a dp rank's rows, shared by its pp x cp x tp ranks."""
    return est.batch_size * est.seq_len / (est.tp * est.cp * est.pp)


def comm_seconds(est: Estimate, cluster: Cluster) -> dict[str, dict[str, float]]:
    """Per mesh dim, per collective: seconds of all of its calls in one step."""
    out: dict[str, dict[str, float]] = {}
    for stat in est.comms:
        stride = dim_stride(stat.dim, est.tp, est.ep, est.dp // est.dp_replicate, est.tp * est.cp * est.dp)
        per_node = members_per_node(stat.group_size, stride, cluster.gpu.gpus_per_node)
        out.setdefault(stat.dim, {})[stat.collective] = collective_seconds(stat, per_node, cluster)
    return out


def fsdp_edges(times: dict[str, float], counts: dict[str, int], at_end: bool = False) -> tuple[float, float]:
    """(the first all-gather and the last reduction, the rest) of one dim's overlapped collectives;
    ``at_end``: every reduction is a last one (a pipeline stage's FSDP2 reduces its whole gradients
    after the schedule's step, with no compute left to hide them)."""
    first = times.get("all_gather", 0.0) / max(counts.get("all_gather", 1), 1)
    last_key = "reduce_scatter" if "reduce_scatter" in times else "all_reduce"
    last = times.get(last_key, 0.0) / (1 if at_end else max(counts.get(last_key, 1), 1))
    return first + last, sum(times.values()) - first - last


def overlapped_exposed(est: Estimate, comm: dict[str, dict[str, float]], compute: float) -> dict[str, float]:
    """Each overlapped dim's exposed time: its edges (:func:`fsdp_edges`) and its share of what all
    of them together take beyond the compute (FSDP2's gathers and reductions and HSDP's all-reduce
    across replicas hide behind the same compute, not each behind all of it)."""
    parts = {}
    for dim in (d for d in sorted(comm) if d in OVERLAPPED_DIMS):
        counts = {c.collective: c.count for c in est.comms if c.dim == dim}
        parts[dim] = fsdp_edges(comm[dim], counts, at_end=est.pp > 1)
    rest = sum(r for _, r in parts.values())
    excess = max(0.0, rest - compute)
    return {dim: edges + (excess * r / rest if rest else 0.0) for dim, (edges, r) in parts.items()}


def predict(est: Estimate, cluster: Cluster) -> Speed:
    """The step time of ``est`` on ``cluster`` and its breakdown (see the module docstring)."""
    seconds = compute_seconds(est, cluster.gpu)
    compute = sum(seconds.values())
    comm = comm_seconds(est, cluster)
    hidden = overlapped_exposed(est, comm, compute)
    for dim, times in sorted(comm.items()):
        seconds[f"{dim} exposed"] = hidden[dim] if dim in hidden else sum(times.values())
    if est.pp > 1:
        busy = sum(
            t for k, t in seconds.items() if k in COMPUTE_PARTS or k.split()[0] not in (*OVERLAPPED_DIMS, "world")
        )
        bubble = bubble_fraction(est.pp, est.microbatches, est.pp_virtual_stages)
        seconds[BUBBLE] = busy * bubble / (1 - bubble)
    step = sum(seconds.values())
    tokens = tokens_per_gpu(est)
    return Speed(
        gpu=cluster.gpu.name,
        step_seconds=step,
        seconds=seconds,
        comm={dim: sum(t.values()) for dim, t in comm.items()},
        tokens_per_second_per_gpu=tokens / step,
        mfu=mfu(est.model_flops_per_token, tokens / step, cluster.gpu.peak_flops(est.dtype)),
        assumptions=assumptions(est, cluster),
    )


def assumptions(est: Estimate, cluster: Cluster) -> list[str]:
    """The footnote: every constant and simplification behind a prediction."""
    g = cluster.gpu
    nodes = max(1, -(-est.world_size // g.gpus_per_node))
    return [
        f"{g.description}; {nodes} node(s), {cluster.inter_node_gbps:g} Gb/s network per GPU.",
        f"Peak {g.peak_flops(est.dtype) / 1e12:,.1f} TFLOP/s ({est.dtype}, dense); matmuls at "
        f"{g.matmul_efficiency:.1%} of it (published max achievable matmul FLOP/s), attention at "
        f"{g.attention_efficiency:.0%} (published flash-attention figure), "
        + ("counted causal (half the scores)." if est.cp == 1 else "counted in full (cp: a masked kernel, below)."),
        f"Other kernels move the bytes eager PyTorch reads and writes, at {g.hbm_efficiency:.0%} of "
        f"{g.hbm_bandwidth / 1e12:.2f} TB/s HBM; no fusion (torch.compile would remove part of it).",
        f"Collectives: NCCL ring, {BASE_LATENCY * 1e6:.1f} us per call + {STEP_LATENCY['NVLink'] * 1e6:.1f} us "
        f"(NVLink) / {STEP_LATENCY['net'] * 1e6:.0f} us (network) per ring step (NCCL's tuning model); "
        f"{g.link} {g.link_bandwidth / 1e9:.0f} GB/s per direction at {g.link_efficiency:.0%}, network at "
        f"{NET_EFFICIENCY:.0%}; tp groups inside a node, dp/cp/ep groups across nodes when the job spans nodes.",
        "Exposed: TP/SP, CP, EP all-to-all and norm collectives entirely (no async TP); FSDP2's all-gathers and "
        "reduce-scatters hide behind compute except the first and the last and any excess over compute"
        + (
            " (under pp every reduce-scatter is a last one: a stage reduces after the schedule's step)."
            if est.pp > 1
            else "."
        ),
        "Not modelled: kernel launch gaps, NCCL slowing concurrent compute, stragglers, data loading, "
        "uneven expert routing. MFU = 6N + 12LHS FLOPs per token (routed experts as top-k of them; hf-tp train's "
        "definition) x tokens/s per GPU / peak.",
        *layout_assumptions(est, cluster),
    ]


def layout_assumptions(est: Estimate, cluster: Cluster) -> list[str]:
    """Footnote lines for context parallelism and LoRA (none for a plain run)."""
    out = []
    if est.cp > 1:
        where = "NVLink" if est.tp * est.cp <= cluster.gpu.gpus_per_node else "the network"
        out.append(
            f"cp={est.cp}: a GPU keeps 1/{est.cp} of each row's tokens (tokens/s per GPU = batch x seq / (tp x cp) / "
            f"step). Each layer all-gathers K and V over the cp group (tp ranks apart, on {where} here) in forward "
            "and recompute and reduce-scatters dK/dV in backward, all on the critical path. Attention runs SDPA "
            "with a boolean mask of global positions, whose kernel computes every score (no causal skipping). "
            "FSDP2 shards over dp x cp: its collectives are listed as dp, group size dp x cp."
        )
    if est.pp > 1:
        where = "the network" if est.tp * est.cp * est.dp >= cluster.gpu.gpus_per_node else "NVLink"
        v = f" x {est.pp_virtual_stages} virtual stages" if est.pp_virtual_stages > 1 else ""
        bubble = bubble_fraction(est.pp, est.microbatches, est.pp_virtual_stages)
        out.append(
            f"pp={est.pp}{v}, {est.pp_schedule}, {est.microbatches} micro-batches of {est.batch_size // est.microbatches} "
            f"row(s): the busiest rank ({est.stage_layers} decoder layers, simulated with the embedding and lm_head "
            f"both) runs each micro-batch; it idles {bubble:.1%} of the step (the bubble, (pp-1)/(V*M+pp-1)); "
            f"each micro-batch's boundary activations and their gradients cross to the next stage over {where}, "
            "exposed; FSDP2 gathers once per micro-batch, hidden behind the step's compute, and reduce-scatters "
            "the stage's gradients once, after the schedule's step: exposed"
            + ("; a routing pass (one no-grad forward) first for the MoE's aux loss." if est.routing_pass else ".")
        )
    if est.lora_r:
        out.append(
            f"LoRA r={est.lora_r} on {est.lora_target_modules}: the frozen base computes no weight gradients (the "
            "traced step does ~4 FLOPs per base parameter and token, not 6, while MFU counts 6, as hf-tp train's "
            "does) and FSDP2 "
            "reduce-scatters only the adapters' gradients (the base is still all-gathered, in the compute dtype)."
        )
    return out
