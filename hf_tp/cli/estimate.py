"""``hf-tp estimate``: per-rank memory and communication of a run, or the best (tp, dp) for N GPUs.

Simulated on this machine's CPU (fake process group, fake tensors): no GPU, no weights, no
network for the bundled models.
"""

from __future__ import annotations

import argparse
import json
import sys

from hf_tp.cli.formatting import subcommand_parser

EPILOG = """examples:
  hf-tp estimate --model qwen2-0.5b --tp 2 --dp 8 --seq-len 2048 --batch-size 1
  hf-tp estimate --model llama-3.1-8b --world-size 16 --gpu-memory 80GiB --seq-len 8192 --batch-size 1
  hf-tp estimate --model Qwen/Qwen3-30B-A3B --tp 2 --dp 8 --ep 4 --seq-len 4096 --batch-size 1

--ep simulates expert parallelism with balanced routing (every expert gets the same number of
rows): real routing is uneven, and a hot rank's all-to-all can be larger."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hf_tp.estimate.bundled import bundled_models  # json files only: no torch for --help

    names = ", ".join(bundled_models())
    p.add_argument("--model", required=True, help=f"bundled short name ({names}), local dir/config.json, or Hub id")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP2) size")
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size for MoE models: ranks borrowed from dp (divides dp)"
    )
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, required=True, help="sequences per dp rank per micro-step")
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16: FSDP2 mixed precision, fp32 master weights"
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder layer")
    p.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GiB or 141GB: sweep (tp, dp) and recommend one")
    p.add_argument("--world-size", type=int, help="GPUs to split into (tp, dp) for the sweep (default: tp*dp)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    from hf_tp.estimate.api import estimate
    from hf_tp.estimate.configs import resolve_model_config
    from hf_tp.estimate.report import format_estimate, format_sweep
    from hf_tp.estimate.sweep import parse_memory, sweep

    try:
        config, name = resolve_model_config(args.model)
        common = dict(
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            dtype=args.dtype,
            activation_checkpointing=args.activation_checkpointing,
            model_name=name,
            ep=args.ep,
        )
        if args.gpu_memory is None and args.world_size is None:
            result = estimate(config, args.tp, args.dp, **common)
            print(json.dumps(result.to_dict(), indent=2) if args.json else format_estimate(result))
            return 0
        gpu = parse_memory(args.gpu_memory) if args.gpu_memory is not None else None
        world = args.world_size if args.world_size is not None else args.tp * args.dp

        def progress(tp: int, dp: int) -> None:
            if not args.json:
                print(f"hf-tp estimate: simulating tp={tp} x dp={dp} ...", file=sys.stderr, flush=True)

        result = sweep(config, world, gpu_memory=gpu, progress=progress, **common)
    except ValueError as exc:
        print(f"hf-tp estimate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_sweep(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = subcommand_parser("hf-tp estimate", __doc__, EPILOG)
    add_arguments(p)
    return run(p.parse_args(argv))
