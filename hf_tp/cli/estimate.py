"""``hf-tp estimate``: per-rank memory and communication of a run, or the best (tp, dp) for N GPUs.

Simulated on this machine's CPU (fake process group, fake tensors): no GPU, no weights, no
network for the bundled models.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hf_tp.cli.formatting import add_dims_flags, add_model_flag, subcommand_parser

EPILOG = """examples:
  hf-tp estimate --model qwen2-0.5b --tp 2 --dp 8 --seq-len 2048 --batch-size 1
  hf-tp estimate --model llama-3.1-8b --world-size 16 --gpu-memory 80GiB --seq-len 8192 --batch-size 1
  hf-tp estimate --model Qwen/Qwen3-30B-A3B --tp 2 --dp 8 --ep 4 --seq-len 4096 --batch-size 1
  hf-tp estimate --model llama-3.1-8b --tp 2 --dp 4 --seq-len 8192 --batch-size 1 --gpu h100-sxm
  hf-tp estimate --model llama-3.1-70b --gpu h100-sxm --world-size 64 --seq-len 8192
  hf-tp estimate --model llama-3.1-70b --tp 8 --dp 1 --seq-len 4096 --lora-r 16
  hf-tp estimate --model llama-3.1-8b --gpu h100-sxm --world-size 16 --cp 2 --seq-len 32768
  hf-tp estimate --model llama-3.1-405b --pp 8 --tp 8 --dp 8 --microbatches 16 --batch-size 16 --seq-len 8192 --gpu h100-sxm

--gpu predicts step time, tokens/s per GPU and MFU (docs/estimate.md: the model, its published
constants and how it compares with published runs); with --world-size it ranks the layouts that
fit that GPU by predicted tokens/s, doubling the per-rank --batch-size (up to 8x) where memory
allows; --cp, --ep and --lora-r stay fixed in a sweep; across nodes it also tries HSDP and pipeline
layouts (docs/scale.md).

--ep simulates expert parallelism with balanced routing (every expert gets the same number of
rows): real routing is uneven, and a hot rank's all-to-all can be larger.

A sweep estimates each layout from the model cut to a few periods of its decoder layers, extended
to its depth, then checks the recommended layout one period deeper: the extension must predict that
run exactly, else the layout is simulated at every layer (--full: every layout at every layer;
--fast: no check). One layout is simulated at every layer (--fast: extended from short runs). A
sweep's simulations run in --jobs worker processes (default: one per core)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hf_tp.gpus import DEFAULT_INTER_NODE_GBPS, GPUS

    add_model_flag(p)
    add_dims_flags(p)  # ParallelDims' fields (hf_tp.core.dims), as hf-tp train takes them
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="sequences per dp rank per micro-step (default 1); a --gpu sweep tries up to 8x it where memory allows",
    )
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16: FSDP2 mixed precision, fp32 master weights"
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder layer")
    p.add_argument(
        "--images-per-row", type=int, default=0, help="a multimodal wrapper on image + text rows: images in each row"
    )
    p.add_argument("--image-size", type=int, default=0, help="pixels of an image's side (towers of any size)")
    p.add_argument("--lora-r", type=int, default=0, help="a LoRA run of rank R (frozen base in --dtype)")
    p.add_argument(
        "--lora-target-modules", default="all-linear", help="with --lora-r: all-linear or names such as q_proj,v_proj"
    )
    p.add_argument(
        "--objective",
        choices=["sft", "dpo", "simpo"],
        default="sft",
        help="dpo / simpo: --batch-size counts preference pairs (two rows each); dpo counts its reference model "
        "(a frozen copy without --lora-r)",
    )
    p.add_argument("--precompute-ref", action="store_true", help="dpo: the reference scored once before training")
    p.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GiB or 141GB: sweep (tp, dp) and recommend one")
    p.add_argument(
        "--world-size",
        type=int,
        help="GPUs to split into (tp, dp) for the sweep, --cp and --ep fixed (default: tp*cp*dp)",
    )
    p.add_argument("--gpu", help=f"predict speed on this GPU: {', '.join(GPUS)}")
    p.add_argument(
        "--inter-node-gbps",
        type=float,
        default=DEFAULT_INTER_NODE_GBPS,
        help=f"network bandwidth per GPU across nodes in Gb/s, one direction (default {DEFAULT_INTER_NODE_GBPS:g})",
    )
    _add_depth_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _add_depth_arguments(p: argparse.ArgumentParser) -> None:
    """``--fast`` / ``--full``: how many decoder layers each estimate simulates."""
    depth = p.add_mutually_exclusive_group()
    depth.add_argument(
        "--fast",
        action="store_true",
        help="extend every estimate from a few periods of the decoder layers, a sweep's recommendation too",
    )
    depth.add_argument(
        "--full", action="store_true", help="a sweep: simulate every layer of every layout (one layout's default)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="a sweep: worker processes simulating layouts at once (default: one per CPU core)",
    )


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from hf_tp.cli.estimate_report import format_ranking, format_sweep
    from hf_tp.estimate.depth import WorkerDied
    from hf_tp.estimate.spec import image_load, parse_memory, resolve_model_config
    from hf_tp.estimate.sweep import estimate_candidate, sweep

    try:
        jobs = _jobs(args.jobs)  # (checked for one layout too: nonsense is refused wherever it is given)
        cluster = make_cluster(args)
        config, name = resolve_model_config(args.model)
        spec = spec_of(args)
        if args.gpu_memory is None and args.world_size is None:
            shape = (args.images_per_row, args.image_size, args.seq_len, args.batch_size, args.tp, args.dtype)
            images = image_load(config, *shape, projector_trains=not args.lora_r) if args.images_per_row else None
            one = replace(estimate_candidate(config, spec, name, args.fast), images=images)
            return print_single(one, cluster, args.json, _reference(args, one, config))
        if args.images_per_row:
            raise ValueError(
                "--images-per-row sizes one layout; the --gpu-memory/--world-size sweep does not count images"
            )
        if args.objective == "dpo" and not (args.lora_r or args.precompute_ref):
            raise ValueError(
                "--objective dpo's frozen reference copy is counted for one layout (--tp/--dp), not in the "
                "--gpu-memory/--world-size sweep yet; give one layout, or --lora-r / --precompute-ref (no copy)"
            )
        if args.dp_replicate != 1 or args.pp != 1:
            raise ValueError(
                "--dp-replicate and --pp size one layout: the --gpu-memory/--world-size sweep chooses them itself "
                "(with --gpu, across nodes); drop them"
            )
        gpu = parse_memory(args.gpu_memory) if args.gpu_memory is not None else None
        world = args.world_size if args.world_size is not None else spec.world_size
        start = time.perf_counter()

        def progress(message: str) -> None:
            if not args.json:
                print(
                    f"hf-tp estimate: [{time.perf_counter() - start:5.0f} s] {message} ...", file=sys.stderr, flush=True
                )

        result = sweep(
            config, world, spec, gpu_memory=gpu, model_name=name, progress=progress, cluster=cluster,
            fast=not args.full, verified=0 if args.fast else 1, verify="check", jobs=jobs,
        )  # fmt: skip
    except (ValueError, WorkerDied) as exc:
        print(f"hf-tp estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_sweep(result, wall_seconds=time.perf_counter() - start))  # wall time, not summed workers
        if cluster is not None:
            print("\n" + format_ranking(result))
    return 0


def _jobs(jobs: int | None) -> int:
    """``--jobs``: a positive count, one per core by default."""
    from hf_tp.estimate.depth import default_jobs

    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got --jobs {jobs}")
    return jobs or default_jobs()


def spec_of(args: argparse.Namespace):
    """The :class:`~hf_tp.estimate.spec.EstimateSpec` of the command line."""
    from hf_tp.estimate.spec import EstimateSpec

    return EstimateSpec(
        tp=args.tp,
        dp=args.dp,
        seq_len=args.seq_len,
        # a micro-batch of B preference pairs is 2B rows (chosen, then rejected)
        batch_size=args.batch_size if args.objective == "sft" else 2 * args.batch_size,
        dtype=args.dtype,
        activation_checkpointing=args.activation_checkpointing,
        ep=args.ep,
        lora_r=args.lora_r,
        lora_target_modules=args.lora_target_modules,
        cp=args.cp,
        dp_replicate=args.dp_replicate,
        pp=args.pp,
        pp_schedule=args.pp_schedule,
        pp_virtual_stages=args.pp_virtual_stages,
        microbatches=args.microbatches or args.pp,
    )


def make_cluster(args: argparse.Namespace):
    """The named GPU cluster of ``--gpu``/``--inter-node-gbps``, or None without ``--gpu``."""
    from hf_tp.estimate.speed import Cluster
    from hf_tp.gpus import get_gpu

    if args.gpu is None:
        return None
    cluster = Cluster(get_gpu(args.gpu), args.inter_node_gbps)
    cluster.gpu.peak_flops(args.dtype)  # no published peak for this dtype: fail before simulating
    return cluster


def _reference(args: argparse.Namespace, est, config):
    """What a preference objective's reference adds (:mod:`hf_tp.estimate.estimate_run`), or None."""
    if args.objective == "sft":
        return None
    from hf_tp.estimate.estimate_run import reference_cost

    return reference_cost(est, config, args.objective, args.precompute_ref)


def print_single(result, cluster, as_json: bool, reference=None) -> int:
    """One layout's memory and comms, its predicted speed where a GPU is named, and a preference
    objective's reference model (``reference``, a :class:`hf_tp.estimate.estimate_run.ReferenceCost`)."""
    from hf_tp.cli.estimate_report import format_estimate, format_speed
    from hf_tp.estimate.speed import predict

    speed = None if cluster is None else predict(result, cluster)
    if as_json:
        out = result.to_dict()
        if speed is not None:
            out.update(gpu=cluster.gpu.to_dict(), inter_node_gbps=cluster.inter_node_gbps, speed=speed.to_dict())
        if reference is not None:
            out.update(reference=reference.to_dict())
        print(json.dumps(out, indent=2))
    else:
        print(format_estimate(result))
        if reference is not None:
            pairs = result.batch_size // 2
            rows = f"{pairs} pair{'s' if pairs > 1 else ''} = {result.batch_size} rows per dp rank (the step above)"
            print("\n" + "\n".join([f"--objective {reference.objective}: {rows}", *reference.lines()]))
        if speed is not None:
            print("\n" + format_speed(result, speed, cluster))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = subcommand_parser("hf-tp estimate", __doc__, EPILOG)
    add_arguments(p)
    return run(p.parse_args(argv))
