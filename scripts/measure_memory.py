"""Compare ``hf-tp estimate`` with a real CPU measurement of the same training step.

    OMP_NUM_THREADS=1 python scripts/measure_memory.py                 # tp=1, dp=1, one process
    OMP_NUM_THREADS=1 python scripts/measure_memory.py --tp 2          # 2 gloo processes (torchrun)

This process first runs the estimate (fake process group, fake tensors); then tp*dp ranks (this
process for one rank, else torchrun workers) build the model for real (random weights, gloo) and
run tracked training steps with torch's MemTracker; it prints estimate vs measurement per
category, with the relative error, for the rank with the highest peak.
The peak resident set size (RSS) growth is printed for reference: it also holds allocator and
library overhead that neither MemTracker figure counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, PretrainedConfig

import hf_tp
from hf_tp.estimate import estimate
from hf_tp.estimate.estimate_run import MemoryBreakdown, MiB
from hf_tp.estimate.simulate import measure
from hf_tp.estimate.spec import resolve_model_config

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "other", "total")


def small_llama() -> PretrainedConfig:
    """A ~45M-parameter Llama: big enough that tensors dominate, small enough for a 2-core CPU."""
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="bundled short name, local dir or config.json (default: a ~45M Llama)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--lora-r", type=int, default=0, help="a LoRA run of this rank (frozen base in --dtype)")
    p.add_argument("--lora-target-modules", default="all-linear")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, nccl")
    p.add_argument("--steps", type=int, default=2, help="tracked real steps (the peak is over all of them)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--ranks-out", help=argparse.SUPPRESS)  # internal: where torchrun workers put their results
    return p.parse_args(argv)


def measure_ranks(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """Real measurements of every rank: in this process for a world of 1, else through torchrun."""
    world = args.tp * args.dp
    if world == 1:
        dist.init_process_group(backend(args), store=dist.HashStore(), rank=0, world_size=1)
        return measure_this_rank(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
        cmd += [__file__, *argv, "--ranks-out", str(out)]
        code = subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
        if code != 0 or not out.exists():
            raise SystemExit(f"measure_memory: the {world} measuring processes failed (exit code {code})")
        return json.loads(out.read_text())


def backend(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return "nccl"
    return "gloo"


def measure_this_rank(args: argparse.Namespace) -> list[dict]:
    """Measure this rank (process group already initialised); return every rank's result."""
    config, _ = model_config(args)
    try:
        mesh = hf_tp.build_mesh(tp=args.tp, dp=args.dp, device_type=args.device)
        lora = dict(lora_r=args.lora_r, lora_target_modules=args.lora_target_modules)
        real = measure(
            config,
            mesh,
            args.seq_len,
            args.batch_size,
            args.dtype,
            args.activation_checkpointing,
            steps=args.steps,
            **lora,
        )
        mine = {
            "peak": real.peak.to_dict(),
            "rss_peak_delta": real.rss_peak_delta,
            "seconds": real.seconds,
            "cuda_peak": real.cuda_peak,
        }
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    finally:
        dist.destroy_process_group()
    return gathered


def model_config(args: argparse.Namespace) -> tuple[PretrainedConfig, str]:
    return resolve_model_config(args.model) if args.model else (small_llama(), "small-llama-45M")


def report(est: MemoryBreakdown, real: MemoryBreakdown, rss: list[int | None]) -> str:
    lines = [f"{'category':<14}{'estimate MiB':>14}{'measured MiB':>14}{'rel. error':>12}"]
    for name in CATEGORIES:
        e, r = (est.total, real.total) if name == "total" else (getattr(est, name), getattr(real, name))
        err = f"{(e - r) / r:+.2%}" if r else ("0" if e == 0 else "n/a")
        lines.append(f"{name:<14}{e / MiB:>14.1f}{r / MiB:>14.1f}{err:>12}")
    if all(x is not None for x in rss):
        per_rank = ", ".join(f"{x / MiB:.1f}" for x in rss)
        lines.append(f"for reference, peak RSS during the steps minus RSS before the model build, MiB: {per_rank}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.ranks_out:  # a torchrun worker started by measure_ranks
        dist.init_process_group(backend(args))
        gathered = measure_this_rank(args)
        if int(os.environ["RANK"]) == 0:
            Path(args.ranks_out).write_text(json.dumps(gathered))
        return 0
    try:
        config, name = model_config(args)
        # First, in this process and before any real process group (it runs its own fake one).
        lora = dict(lora_r=args.lora_r, lora_target_modules=args.lora_target_modules)
        est = estimate(
            config,
            args.tp,
            args.dp,
            args.seq_len,
            args.batch_size,
            args.dtype,
            args.activation_checkpointing,
            model_name=name,
            **lora,
        )
    except ValueError as exc:
        print(f"measure_memory: error: {exc}", file=sys.stderr)
        return 2
    ranks = measure_ranks(args, argv)
    # Ranks of a (tp, dp) mesh hold the same shapes; compare with the rank that peaks highest.
    worst = max(ranks, key=lambda r: r["peak"]["total"])
    real_peak = MemoryBreakdown(**{k: v for k, v in worst["peak"].items() if k != "total"})
    ac = ", activation checkpointing" if args.activation_checkpointing else ""
    ac += f", LoRA r={args.lora_r} on {args.lora_target_modules}" if args.lora_r else ""
    print(
        f"{name}: {est.num_params / 1e6:.1f}M params, tp={args.tp} dp={args.dp}, seq {args.seq_len} x batch "
        f"{args.batch_size}, {args.dtype}{ac}; torch {torch.__version__}"
    )
    slowest = max(r["seconds"] for r in ranks)
    print(f"estimate: {est.seconds:.1f} s; real: {args.steps} steps in {slowest:.1f} s per rank")
    print(report(est.peak, real_peak, [r["rss_peak_delta"] for r in ranks]))
    if worst.get("cuda_peak") is not None:
        cuda_peak = max(r["cuda_peak"] for r in ranks)
        print(
            f"torch.cuda.max_memory_allocated during the steps: {cuda_peak / MiB:.1f} MiB "
            f"(estimate {est.peak.total / MiB:.1f} MiB, {(est.peak.total - cuda_peak) / cuda_peak:+.2%})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"estimate": est.to_dict(), "measured": ranks}, indent=2))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.exit(main())
