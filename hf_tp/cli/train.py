"""``hf-tp train``: parse flags and YAML into a TrainConfig, then launch or run the ranks."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from hf_tp.cli.formatting import subcommand_parser
from hf_tp.cli.train_flags import add_setting_flags
from hf_tp.core.setting import help_title
from hf_tp.run.config import GROUPS, TrainConfig, merge
from hf_tp.run.settings_data import ModelAndData
from hf_tp.run.settings_run import Launch

DESCRIPTION = """Train a Hugging Face causal LM with tensor + sequence parallel x FSDP2: starts tp*dp processes on
this node (gloo on CPU, nccl on GPUs), or runs in place under torchrun / accelerate launch. Bad input
stops it with one line, before any process starts where the inputs alone decide."""

EPILOG = """examples:
  hf-tp train          # the embedded tiny Llama and toy corpus, tp=2 x dp=2 on CPU (~1 min)
  hf-tp train --model Qwen/Qwen2-0.5B --dataset corpus.jsonl --tp 2 --dp 4 --seq-len 2048 --batch-size 4
  hf-tp train --config configs/qwen2-0.5b-tp2-dp4.yaml --dataset corpus.jsonl --save-every 100 --resume
  hf-tp train --model Qwen/Qwen2-0.5B-Instruct --dataset chats.jsonl --eval-split 0.05 --eval-every 50

Settings: defaults < --config YAML < flags. "embedded default" means without --model."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every setting's flags, generated from TrainConfig's fields in their groups
    (:mod:`hf_tp.cli.train_flags`), plus the two flags that are no setting: --config and --verbose."""
    titles = dict.fromkeys(help_title(group, f.name) for group in GROUPS for f in fields(group))  # in order
    groups = {title: p.add_argument_group(title) for title in titles}
    groups[ModelAndData.TITLE].add_argument(
        "--config", metavar="FILE", help="YAML file of settings, keys as these flags; flags override it (default: none)"
    )
    add_setting_flags(groups)
    groups[Launch.TITLE].add_argument(
        "--verbose",
        action="store_true",
        help="show the launcher's own output (torch elastic warnings and tracebacks) and every rank's error, "
        "not only the first error (default: off)",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """defaults < --config YAML < flags."""
    cfg = TrainConfig()
    if args.config:
        cfg = merge(cfg, TrainConfig.from_yaml(args.config))
    flags = {k: v for k, v in vars(args).items() if k in TrainConfig.field_names()}
    return merge(cfg, flags)


def run(args: argparse.Namespace) -> int:
    from hf_tp.cli.auto_layout import auto_layout, check_request
    from hf_tp.train.embedded_run import with_embedded_default

    in_rank = "WORLD_SIZE" in os.environ
    try:
        cfg = config_from_args(args)
        check_request(cfg)
        cfg.resolve().validate()  # the numbers alone, before torch is imported
        from hf_tp.run.validate import device_type as find_device_type
        from hf_tp.run.validate import load_model_config, prelaunch_checks

        cfg = with_embedded_default(cfg)
        if cfg.layout == "auto":
            cfg = auto_layout(cfg, load_model_config(cfg.model, cfg.trust_remote_code))
        device_type = find_device_type(cfg) if in_rank else prelaunch_checks(cfg)
        release = lock_output_dir(cfg, in_rank)  # one writer per run folder, held to the end
    except ValueError as exc:
        print(f"hf-tp train: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _started(cfg, args, device_type, in_rank)
    finally:
        release()


def _started(cfg: TrainConfig, args: argparse.Namespace, device_type: str, in_rank: bool) -> int:
    """The run, accepted: launch the ranks, or train in this process."""
    from hf_tp.run.launch import launch, start_line

    if os.environ.get("RANK", "0") == "0" and not os.environ.get("HF_TP_LAUNCHED"):
        print(start_line(cfg, device_type, launching=not in_rank and cfg.world_size > 1), flush=True)
    if not in_rank and cfg.world_size > 1:
        if warning := oversubscribed(cfg, device_type):
            print(f"hf-tp train: warning: {warning}", file=sys.stderr, flush=True)
        # The ranks read their settings from a file of the launch's own; the run's config.yaml is
        # written by rank 0 once the run is accepted (hf_tp.run.run_dir).
        return launch(cfg, verbose=args.verbose)
    from hf_tp.run.distributed import shutdown
    from hf_tp.run.errors import report_rank_error
    from hf_tp.train.loop import train

    try:
        result = train(cfg)
    except Exception as exc:  # noqa: BLE001 - one line (an unexpected error's traceback kept in a file)
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        expected = isinstance(exc, (ValueError, FloatingPointError, RuntimeError))
        if not expected and (in_rank or args.verbose):
            raise  # under torchrun each rank prints its own traceback, as a script would
        code = report_rank_error(exc, rank, crash=not expected)
        if dist.is_initialized():
            # No barrier: the other ranks may be waiting in another collective and never reach
            # it. Abort, not destroy: destroy is the normal exit and may wait for collectives in
            # flight (NCCL), abort returns at once (for gloo both only forget the groups). The
            # non-zero exit makes the launcher stop the other ranks.
            from hf_tp.compat.torch_distributed import abort_process_group

            abort_process_group()
        return code
    shutdown()
    if result.preempted_at is not None:
        from hf_tp.run.faults import EXIT_PREEMPTED

        return EXIT_PREEMPTED  # a requeue script's cue (scripts/slurm_train.sh)
    return 0


def lock_output_dir(cfg: TrainConfig, in_rank: bool) -> Callable[[], None]:
    """Take the run folder's lock (:mod:`hf_tp.train.run_lock`; ``ValueError`` when another run holds
    it) where this process holds it for the run: the launching process of node 0, a run in this
    process, rank 0 under torchrun; ranks started by hf-tp train take none (their launcher holds
    it). Returns what releases it."""
    mine = os.environ.get("RANK", "0") == "0" if in_rank else cfg.node_rank == 0
    if os.environ.get("HF_TP_LAUNCHED") or not mine:
        return lambda: None
    from hf_tp.train.run_lock import take

    return take(Path(cfg.output_dir).expanduser())


def oversubscribed(cfg: TrainConfig, device_type: str) -> str | None:
    """A warning when this node's CPU ranks outnumber the cores they may use (GPUs are checked:
    one per rank)."""
    if device_type != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = cfg.world_size // cfg.nnodes
    if ranks <= cores:
        return None
    plural = "s" if cores > 1 else ""
    return f"{ranks} ranks share {cores} CPU core{plural}; they take turns, so steps run slower than with fewer ranks (fine to check a layout)"


def build_parser() -> argparse.ArgumentParser:
    """``hf-tp train`` on its own (``python -m hf_tp.train``; docs/training.md's flag table)."""
    p = subcommand_parser("hf-tp train", DESCRIPTION, EPILOG)
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
