"""The tables of docs/scale.md: for each model, GPU and number of GPUs, the fastest layout the
estimate predicts that fits (``hf-tp estimate --gpu G --world-size N``: tp, dp, HSDP and pipeline
layouts), and the fastest of each kind, so the tables show when each pays off.

Each (model, GPU, GPUs) is one sweep (:func:`hf_tp.estimate.sweep.sweep`, the per-rank batch grown
up to 8x where memory allows, pipeline layouts at 8 x pp micro-batches). A row per sweep: the
fastest layout that fits with the sweep's margins (peak x 1.10 + 1 GiB <= GPU memory), its
tokens/s per GPU, MFU, peak and headroom, and the fastest plain FSDP2 (tp x dp), HSDP and pipeline
layouts. "-" where no layout of that kind fits.

    OMP_NUM_THREADS=1 python scripts/scale_tables.py > /tmp/scale.md            # every row
    python scripts/scale_tables.py --models llama-3.1-70b --gpus h100-sxm --worlds 64
    python scripts/scale_tables.py --verified 1          # each row's best simulated at every layer
    python scripts/scale_tables.py --layouts             # Llama-3.1-405B's single layouts on 512 GPUs

Each layout's stage is estimated from short runs extended to its depth (``hf-tp estimate``'s fast
estimate, :mod:`hf_tp.estimate.depth`: equal to the every-layer simulation to the byte on the cases
of docs/estimate.md), and each row's best checked as ``hf-tp estimate --gpu`` checks it (one period
deeper: its extension must predict that run exactly); ``--verified N`` simulates each sweep's best
N at every layer instead (hours for 405B and DeepSeek-V3 on 2 cores); the simulations run in
``--jobs`` worker processes (one per core by default); ``--simulate module:function``
runs each stage's simulation with another function of :data:`hf_tp.estimate.layouts.Simulate`'s
signature (``hf_tp.estimate.estimate_run:estimate_spec``: every layer of every layout).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_tp.cli.estimate_report import train_flags  # noqa: E402
from hf_tp.estimate.depth import default_jobs  # noqa: E402
from hf_tp.estimate.spec import GiB, resolve_model_config  # noqa: E402
from hf_tp.estimate.speed import Cluster  # noqa: E402
from hf_tp.estimate.sweep import headroom, sweep, usable_peak  # noqa: E402
from hf_tp.gpus import get_gpu  # noqa: E402

MODELS = {"llama-3.1-70b": 8192, "llama-3.1-405b": 8192, "deepseek-v3": 4096}  # name -> seq_len
EP = {"deepseek-v3": 8}  # a MoE's expert parallelism (fixed for a sweep): one node's GPUs by default
GPUS = ("h100-sxm", "h200")
WORLDS = (64, 128, 256, 512)
KINDS = {
    "FSDP2 (tp x dp)": lambda e: e.pp == 1 and e.dp_replicate == 1,
    "HSDP": lambda e: e.pp == 1 and e.dp_replicate > 1,
    "pipeline": lambda e: e.pp > 1,
}


def row(model: str, gpu: str, world: int, simulate, say, verified: int = 0, jobs: int = 1, ep: int = 1) -> str:
    """One markdown row: the sweep of ``model`` on ``world`` x ``gpu``."""
    config, name = resolve_model_config(model)
    start = time.perf_counter()
    result = sweep(
        config, world, seq_len=MODELS[model], batch_size=1, ep=ep, model_name=name, cluster=Cluster(get_gpu(gpu)),
        simulate=simulate, progress=say, verified=verified or 1, verify="full" if verified else "check", jobs=jobs,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    ranked = result.ranking()
    best = {kind: next(((e, s) for e, s in ranked if keep(e)), None) for kind, keep in KINDS.items()}
    cells = [model + (f" (ep {ep})" if ep > 1 else ""), gpu, str(world)]
    if not ranked:
        cells += ["none fits", "-", "-", "-", "-", "-"]
    else:
        e, s = ranked[0]
        cells += [
            f"`{train_flags(e)}`", f"{s.tokens_per_second_per_gpu:,.0f}", f"{s.mfu:.1%}",
            f"{e.peak.total / GiB:.1f}", f"{headroom(e, result.gpu_memory):.1f}", f"{s.bubble_share:.0%}",
        ]  # fmt: skip
    cells += [f"{pair[1].tokens_per_second_per_gpu:,.0f}" if pair else "-" for pair in best.values()]
    cells.append(f"{len(result.estimates)} layouts, {seconds:.0f} s")
    return "| " + " | ".join(cells) + " |"


# Llama-3.1-405B on 512 GPUs, seq 8192, checkpointing: single layouts of 256 rows of 8,192 tokens per
# step (64 dp ranks x 4 rows, or 8 dp ranks x 32 micro-batches of 1 row): (name, EstimateSpec fields)
LAYOUTS_405B = [
    ("tp 8 x FSDP2 64, batch 4", dict(tp=8, dp=64, batch_size=4)),
    ("tp 8 x HSDP 8 x 8, batch 4", dict(tp=8, dp=64, dp_replicate=8, batch_size=4)),
    ("pp 8 (1F1B, 32 micro-batches) x tp 8 x FSDP2 8", dict(tp=8, dp=8, pp=8, microbatches=32, batch_size=32)),
    (
        "pp 8 (Interleaved 1F1B x 2) x tp 8 x FSDP2 8",
        dict(tp=8, dp=8, pp=8, microbatches=32, batch_size=32, pp_schedule="interleaved1f1b", pp_virtual_stages=2),
    ),
    ("pp 8 (1F1B) x tp 8 x HSDP 4 x 2", dict(tp=8, dp=8, dp_replicate=4, pp=8, microbatches=32, batch_size=32)),
    ("pp 8 (1F1B) x tp 8 x HSDP 8 x 1", dict(tp=8, dp=8, dp_replicate=8, pp=8, microbatches=32, batch_size=32)),
]


def layouts_table(say, jobs: int) -> None:
    """The single-layout table of docs/scale.md (``LAYOUTS_405B``), each from the fast estimate
    checked one period deeper, predicted on an H100 SXM and an H200."""
    from hf_tp.estimate.depth import Simulations, Simulator
    from hf_tp.estimate.layouts import estimate_layout
    from hf_tp.estimate.spec import EstimateSpec
    from hf_tp.estimate.speed import predict

    config, name = resolve_model_config("llama-3.1-405b")
    h100, h200 = Cluster(get_gpu("h100-sxm")), Cluster(get_gpu("h200"))
    print(
        "| layout | H100 SXM tok/s/GPU | H200 tok/s/GPU | MFU (H100) | peak GiB | fits 80 GiB / 141 GB | where the H100 step goes (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    with Simulations(jobs) as sims:
        simulate = Simulator(sims, fast=True, check=True)
        for label, fields in LAYOUTS_405B:
            say(f"simulating {label}")
            spec = EstimateSpec(seq_len=8192, activation_checkpointing=True, **fields)
            est = estimate_layout(config, spec, name, simulate)
            a, b = predict(est, h100), predict(est, h200)
            fits = " / ".join(
                "yes" if usable_peak(est.peak.total, c.gpu.memory_bytes) >= 0 else "no" for c in (h100, h200)
            )
            parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(a.seconds.items(), key=lambda kv: -kv[1]) if v >= 0.005)
            print(
                f"| {label} | {a.tokens_per_second_per_gpu:,.0f} | {b.tokens_per_second_per_gpu:,.0f} | {a.mfu:.1%} | "
                f"{est.peak.total / GiB:.1f} | {fits} | {parts} |",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--gpus", nargs="*", default=list(GPUS))
    p.add_argument("--worlds", nargs="*", type=int, default=list(WORLDS))
    p.add_argument("--simulate", help="module:function simulating one stage (default: the fast estimate)")
    p.add_argument("--verified", type=int, default=0, help="each sweep's best N simulated at every layer")
    p.add_argument("--ep", type=int, help=f"expert parallelism of the MoE models (default {EP})")
    p.add_argument("--jobs", type=int, default=default_jobs(), help="worker processes (default: one per core)")
    p.add_argument("--layouts", action="store_true", help="the single-layout table of Llama-3.1-405B on 512 GPUs")
    args = p.parse_args()
    simulate = None
    if args.simulate:
        module, _, function = args.simulate.partition(":")
        simulate = getattr(importlib.import_module(module), function)
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", file=sys.stderr, flush=True)

    if args.layouts:
        layouts_table(say, args.jobs)
        return
    kinds = " | ".join(f"fastest {kind} tok/s/GPU" for kind in KINDS)
    print(
        "| model | GPU | GPUs | fastest layout that fits | tok/s/GPU | MFU | peak GiB | headroom GiB | bubble "
        f"| {kinds} | sweep |"
    )
    print("|" + "---|" * (10 + len(KINDS)))
    for model in args.models:
        for gpu in args.gpus:
            for world in args.worlds:
                ep = (args.ep or EP.get(model, 1)) if model in EP else 1
                print(row(model, gpu, world, simulate, say, args.verified, args.jobs, ep), flush=True)
    print(f"\n({time.perf_counter() - start:.0f} s on this machine's CPU)")


if __name__ == "__main__":
    main()
