"""Predict published training runs with ``hf-tp estimate --gpu`` and print the comparison table.

Each row is a run whose layout and throughput were published (source URL in the row); hf_tp
simulates its nearest layout (hf_tp's estimate has no float8, torch.compile or async TP) on the named GPU and predicts tokens/s per GPU; pipeline
rows (10-12) go through :func:`hf_tp.estimate.layouts.estimate_layout` (the busiest stage simulated,
the schedule by arithmetic). The published figures
are inputs typed from their sources; the predictions are computed here. Offline, CPU only:

    python scripts/estimate_published_runs.py            # every row (a few minutes on 2 cores)
    python scripts/estimate_published_runs.py --only 1 3 # some rows
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from hf_tp.estimate.estimate_run import GiB
from hf_tp.estimate.layouts import estimate_layout
from hf_tp.estimate.spec import EstimateSpec, resolve_model_config
from hf_tp.estimate.speed import Cluster, predict
from hf_tp.gpus import get_gpu

TITAN_H100 = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_A100 = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
AUTOMODEL = "https://github.com/NVIDIA-NeMo/Automodel/blob/main/docs/performance-summary.mdx"
BENCH = "docs/benchmarks.md (hf_tp, measured 2026-11-23)"


@dataclass(frozen=True)
class Run:
    """A published run: its setup as published, and the layout hf_tp simulates for it."""

    label: str
    source: str
    published: str  # the setup as published
    tokens_per_second: float  # published, per GPU
    model: str
    gpu: str
    tp: int
    dp: int
    seq_len: int
    batch_size: int  # rows per dp rank per step (all its micro-batches)
    activation_checkpointing: bool
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    microbatches: int = 1
    ep: int = 1


RUNS = [
    Run("hf_tp Qwen2-0.5B, 1 H200, plain", BENCH, "dp 1, seq 2048 x 8, bf16, eager", 76_922,
        "qwen2-0.5b", "h200", 1, 1, 2048, 8, False),
    Run("hf_tp Qwen2-0.5B, 1 H200, AC", BENCH, "dp 1, seq 2048 x 8, bf16, activation checkpointing", 63_553,
        "qwen2-0.5b", "h200", 1, 1, 2048, 8, True),
    Run("hf_tp Qwen2-0.5B, 1 H200, seq 4096", BENCH, "dp 1, seq 4096 x 4, bf16, eager", 72_901,
        "qwen2-0.5b", "h200", 1, 1, 4096, 4, False),
    Run("torchtitan Llama 3.1 8B, 8 H100", TITAN_H100, "FSDP 8, local batch 2, seq 8192, selective AC, eager", 5_762,
        "llama-3.1-8b", "h100-sxm", 1, 8, 8192, 2, True),
    Run("torchtitan Llama 3.1 8B, 128 H100", TITAN_H100, "FSDP 128, local batch 2, seq 8192, selective AC, eager",
        5_605, "llama-3.1-8b", "h100-sxm", 1, 128, 8192, 2, True),
    Run("torchtitan Llama 3 8B, 64 A100", TITAN_A100, "FSDP 64, batch 1, seq 8192, selective layer AC", 2_904,
        "llama-3.1-8b", "a100-80gb", 1, 64, 8192, 1, True),
    Run("torchtitan Llama 3 70B, 64 A100", TITAN_A100, "FSDP 64, batch 1, seq 8192, full AC", 331,
        "llama-3.1-70b", "a100-80gb", 1, 64, 8192, 1, True),
    Run("torchtitan Llama 3.1 70B, 256 H100", TITAN_H100,
        "FSDP 32 x TP 8, local batch 16, seq 8192, full AC, compile + float8", 829,
        "llama-3.1-70b", "h100-sxm", 8, 32, 8192, 16, True),
    Run("NeMo AutoModel Llama3 70B, 64 H100", AUTOMODEL,
        "FSDP 32 x CP 2, micro-batch 1, seq 8192, TE kernels, FSDP2 prefetch", 866.77,
        "llama-3.1-70b", "h100-sxm", 2, 32, 8192, 1, True),
    Run("torchtitan Llama 3.1 405B, 512 H100, 1F1B", TITAN_H100,
        "FSDP 8 x TP 8 x PP 8, 1F1B, local batch 32, seq 8192, full AC, compile + float8 + async TP", 100,
        "llama-3.1-405b", "h100-sxm", 8, 8, 8192, 32, True, 8, "1f1b", 1, 32),
    Run("torchtitan Llama 3.1 405B, 512 H100, Interleaved 1F1B", TITAN_H100,
        "FSDP 8 x TP 8 x PP 8, Interleaved 1F1B, local batch 32, seq 8192, full AC, compile + float8 + async TP", 128,
        "llama-3.1-405b", "h100-sxm", 8, 8, 8192, 32, True, 8, "interleaved1f1b", 2, 32),
    Run("NeMo AutoModel DeepSeek-V3, 256 H100", AUTOMODEL,
        "PP 4 x VP 8 x EP 64 x FSDP 64, MBS 1, LBS 8, seq 4096, TE + DeepEP, balanced gate", 1_002,
        "deepseek-v3", "h100-sxm", 1, 64, 4096, 8, True, 4, "interleaved1f1b", 8, 8, 64),
]  # fmt: skip


def predict_run(run: Run) -> tuple[float, float, float, float, float]:
    """(predicted tokens/s per GPU, MFU, exposed comm share, peak GiB, simulation seconds) of ``run``."""
    config, name = resolve_model_config(run.model)
    spec = EstimateSpec(
        run.tp, run.dp, run.seq_len, run.batch_size, "bf16", run.activation_checkpointing, ep=run.ep, pp=run.pp,
        pp_schedule=run.pp_schedule, pp_virtual_stages=run.pp_virtual_stages, microbatches=run.microbatches,
    )  # fmt: skip
    est = estimate_layout(config, spec, name)
    speed = predict(est, Cluster(get_gpu(run.gpu)))
    return speed.tokens_per_second_per_gpu, speed.mfu, speed.exposed_comm_share, est.peak.total / GiB, est.seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", type=int, nargs="*", help="row numbers (1-based) to run")
    args = p.parse_args()
    print("| # | run | published setup | hf_tp layout | published tok/s/GPU | predicted | predicted / published "
          "| predicted MFU | exposed comm | peak GiB | source |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    for i, run in enumerate(RUNS, 1):
        if args.only and i not in args.only:
            continue
        tokens, mfu, exposed, peak, _ = predict_run(run)
        pp = ""
        if run.pp > 1:
            v = f" x V {run.pp_virtual_stages}" if run.pp_virtual_stages > 1 else ""
            pp = f"pp {run.pp}{v} ({run.pp_schedule}, {run.microbatches} micro-batches) x "
        ac = "AC" if run.activation_checkpointing else "no AC"
        ep = f" (ep {run.ep})" if run.ep > 1 else ""
        layout = f"{pp}tp {run.tp} x dp {run.dp}{ep}, {run.seq_len} x {run.batch_size}, {ac}"
        print(
            f"| {i} | {run.label} | {run.published} | {layout} | {run.tokens_per_second:,.0f} | {tokens:,.0f} "
            f"| {tokens / run.tokens_per_second:.2f} | {mfu:.1%} | {exposed:.0%} | {peak:.1f} | {run.source} |",
            flush=True,
        )
    print(f"\n({time.perf_counter() - start:.0f} s on this machine's CPU)")


if __name__ == "__main__":
    main()
