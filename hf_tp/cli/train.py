"""``hf-tp train``: parse flags and YAML into a TrainConfig, then launch or run the ranks."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hf_tp.train.config import TrainConfig, merge


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags default to None so that only what the user typed overrides the YAML file."""
    p.add_argument("--config", help="YAML file of settings (keys as these flags); flags override it")
    p.add_argument("--model", help="Hub id or local dir (default: the embedded tiny Llama)")
    p.add_argument("--dataset", help="Hub id, or local .txt/.json/.jsonl/.parquet/.csv file or dir")
    p.add_argument("--text-column")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--no-pack", dest="pack", action="store_const", const=False, help="pad each document")
    p.add_argument("--tp", type=int, help="tensor-parallel size")
    p.add_argument("--dp", type=int, help="data-parallel (FSDP2) size")
    p.add_argument("--batch-size", type=int, help="sequences per dp rank per micro-step")
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--max-grad-norm", type=float, help="0 disables clipping")
    p.add_argument("--seed", type=int)
    p.add_argument("--output-dir")
    p.add_argument("--overwrite", action="store_const", const=True, help="reuse an output dir that holds a run")
    p.add_argument("--log-every", type=int)
    p.add_argument("--save-every", type=int, help="optimizer steps between checkpoints (0: none)")
    p.add_argument("--keep-checkpoints", type=int, help="keep only the newest K checkpoints")
    p.add_argument("--resume", action="store_const", const=True, help="continue from the newest complete checkpoint")
    p.add_argument("--export-on-finish", action="store_const", const=True, help="export an HF folder at the end")
    p.add_argument("--activation-checkpointing", action="store_const", const=True)
    p.add_argument("--compile", action="store_const", const=True, help="torch.compile each decoder layer")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_const", const=False)
    p.add_argument(
        "--no-loss-parallel",
        dest="loss_parallel",
        action="store_const",
        const=False,
        help="replicated instead of vocab-sharded logits (only for models whose lm_head and loss are not fused)",
    )
    p.add_argument(
        "--profile-steps",
        help="profile optimizer steps A-B (e.g. 10-12): Perfetto trace and op table in OUTPUT_DIR/profile",
    )
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_const", const=False)
    p.add_argument("--nnodes", type=int)
    p.add_argument("--node-rank", type=int)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """defaults < --config YAML < flags."""
    cfg = TrainConfig()
    if args.config:
        cfg = merge(cfg, TrainConfig.from_yaml(args.config))
    flags = {k: v for k, v in vars(args).items() if k in TrainConfig.field_names()}
    return merge(cfg, flags)


def run(args: argparse.Namespace) -> int:
    from hf_tp.demo import with_embedded_default
    from hf_tp.train.launch import launch
    from hf_tp.train.loop import train
    from hf_tp.train.setup import resolve_device, shutdown
    from hf_tp.train.validate import prelaunch_checks

    in_rank = "WORLD_SIZE" in os.environ
    try:
        cfg = with_embedded_default(config_from_args(args))
        if not in_rank:
            prelaunch_checks(cfg, resolve_device(cfg).type)
    except ValueError as exc:
        print(f"hf-tp train: error: {exc}", file=sys.stderr)
        return 2
    if not in_rank and cfg.world_size > 1:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.yaml")
        code = launch(cfg, out / "config.yaml")
        if code != 0:
            print(f"hf-tp train: training failed (exit code {code}); the ranks' errors are above", file=sys.stderr)
        return code
    try:
        train(cfg)
    except (ValueError, FloatingPointError, RuntimeError) as exc:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"hf-tp train: error [rank {rank}]: {exc}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 1
    shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hf-tp train", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
