"""``hf-tp train``: parse flags and YAML into a TrainConfig, then launch or run the ranks."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from hf_tp.cli.data_args import add_data_arguments, add_eval_arguments, add_objective_arguments, add_vision_arguments
from hf_tp.cli.formatting import subcommand_parser
from hf_tp.train.config import AUX_LOSS_OVER, EMBEDDED_PROFILE, GENERAL_PROFILE, TrainConfig, merge

DESCRIPTION = """Train a Hugging Face causal LM with tensor + sequence parallel x FSDP2: starts tp*dp processes on
this node (gloo on CPU, nccl on GPUs), or runs in place under torchrun / accelerate launch. Bad input
stops it with one line, before any process starts where the inputs alone decide."""

EPILOG = """examples:
  hf-tp train          # the embedded tiny Llama and toy corpus, tp=2 x dp=2 on CPU (~1 min)
  hf-tp train --model Qwen/Qwen2-0.5B --dataset corpus.jsonl --tp 2 --dp 4 --seq-len 2048 --batch-size 4
  hf-tp train --config configs/qwen2-0.5b-tp2-dp4.yaml --dataset corpus.jsonl --save-every 100 --resume
  hf-tp train --model Qwen/Qwen2-0.5B-Instruct --dataset chats.jsonl --eval-split 0.05 --eval-every 50

Settings: defaults < --config YAML < flags. "embedded default" means without --model."""


def _default(name: str) -> str:
    """The real default of a setting, as help text: the profile values for the ones a profile fills."""

    def show(value: object) -> str:
        return f"{value:g}" if isinstance(value, float) else str(value)

    if name in GENERAL_PROFILE:
        return f"default {show(GENERAL_PROFILE[name])}; {show(EMBEDDED_PROFILE[name])} for the embedded default"
    return f"default {show(next(f.default for f in fields(TrainConfig) if f.name == name))}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags default to None so that only what the user typed overrides the YAML file; the help
    texts state the real defaults (TrainConfig and its two profiles)."""
    _model_and_data(p.add_argument_group("model and data"))
    add_eval_arguments(p.add_argument_group("held-out evaluation"), _default)
    add_objective_arguments(p.add_argument_group("objective (preference training: docs/post-training.md)"), _default)
    sizes = p.add_argument_group("sizes and optimizer")
    _sizes(sizes)
    _auto_layout_flags(sizes)
    _optimizer(sizes)
    _output_and_checkpoints(p.add_argument_group("output and checkpoints"))
    _speed_and_parallelism(p.add_argument_group("speed, precision and parallelism"))
    _launch(p.add_argument_group("launch (several nodes)"))


def _model_and_data(p) -> None:
    p.add_argument(
        "--config", metavar="FILE", help="YAML file of settings, keys as these flags; flags override it (default: none)"
    )
    p.add_argument(
        "--model",
        metavar="ID_OR_DIR",
        help="Hub id (e.g. Qwen/Qwen2-0.5B) or local dir, loaded with from_pretrained, tokenizer included "
        "(default: the embedded tiny Llama, ~150k random-init parameters built locally under ~/.cache/hf_tp "
        "or $HF_TP_CACHE)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_const",
        const=True,
        help="let a model whose config.json's auto_map names classes transformers does not have run that Python "
        "code, on every rank; read it first (default: off, such a model is refused before launch; a model "
        "transformers has is always built from transformers' own classes)",
    )
    add_data_arguments(p, _default)
    add_vision_arguments(p)


def _sizes(p) -> None:
    d = _default
    p.add_argument("--tp", type=int, metavar="N", help=f"tensor-parallel size; must fit the model's heads ({d('tp')})")
    p.add_argument("--dp", type=int, metavar="N", help=f"data-parallel (FSDP2) size; tp*dp processes run ({d('dp')})")
    p.add_argument(
        "--ep",
        type=int,
        metavar="N",
        help=f"expert parallelism for MoE models: each group of N dp ranks splits the experts; must divide "
        f"--dp and the expert count ({d('ep')})",
    )
    p.add_argument(
        "--cp",
        type=int,
        metavar="N",
        help=f"context parallelism for long sequences: each row's tokens split over N ranks; tp*cp*dp "
        f"processes run; rows padded to a multiple of 2*cp*tp ({d('cp')})",
    )
    p.add_argument(
        "--dp-replicate",
        type=int,
        metavar="R",
        help=f"HSDP: dp = R replicas x an FSDP2 group of dp/R ranks sharding the weights; gradients are "
        f"all-reduced across replicas once per step (put replicas across nodes); must divide --dp ({d('dp_replicate')})",
    )


def _optimizer(p) -> None:
    d = _default
    p.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help=f"sequences per dp rank per micro-step; the global batch is batch x dp x grad-accum ({d('batch_size')})",
    )
    p.add_argument("--grad-accum", type=int, metavar="N", help=f"micro-steps per optimizer step ({d('grad_accum')})")
    p.add_argument("--max-steps", type=int, metavar="N", help=f"optimizer steps ({d('max_steps')})")
    p.add_argument("--lr", type=float, help=f"peak learning rate of AdamW, betas 0.9/0.95 ({d('lr')})")
    p.add_argument(
        "--warmup-steps",
        type=int,
        metavar="N",
        help="linear warmup from lr/(N+1) at the first step to lr at step N+1, then cosine decay to "
        f"{TrainConfig.min_lr_ratio:g} x lr at --max-steps ({d('warmup_steps')})",
    )
    p.add_argument("--weight-decay", type=float, metavar="W", help=f"AdamW weight decay ({d('weight_decay')})")
    p.add_argument(
        "--max-grad-norm",
        type=float,
        metavar="X",
        help=f"clip the global gradient norm to X; 0 disables ({d('max_grad_norm')})",
    )
    p.add_argument(
        "--aux-loss-over",
        choices=AUX_LOSS_OVER,
        help="MoE router aux loss under --grad-accum: over the whole step's tokens, as one device computes it "
        "on the global batch (one extra forward without gradients per micro-batch), or over each micro-batch "
        f"as the HF Trainer does ({d('aux_loss_over')})",
    )
    p.add_argument("--seed", type=int, help=f"seed of the data order and of random init ({d('seed')})")
    p.add_argument(
        "--lora-r",
        type=int,
        metavar="R",
        help=f"train LoRA adapters of rank R on a frozen base (peft; pip install hf_tp[lora]); 0: every weight "
        f"({d('lora_r')})",
    )
    p.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA scaling alpha / r (default: 2 x r)")
    p.add_argument("--lora-dropout", type=float, metavar="P", help=f"dropout on the LoRA input ({d('lora_dropout')})")
    p.add_argument(
        "--lora-target-modules",
        metavar="NAMES",
        help=f"all-linear or comma-separated projection names, e.g. q_proj,v_proj ({d('lora_target_modules')})",
    )


def _auto_layout_flags(p) -> None:
    d = _default
    p.add_argument(
        "--layout",
        choices=["manual", "auto"],
        help="auto: choose --tp, --dp and activation checkpointing for --world ranks before launch: with --gpu "
        "the fastest layout the estimate predicts that fits that GPU, else the largest tp the model allows "
        f"({d('layout')})",
    )
    p.add_argument("--gpu", metavar="NAME", help="with --layout auto: the GPU to plan for, as hf-tp estimate --gpu")
    p.add_argument(
        "--world",
        type=int,
        metavar="N",
        help="with --layout auto: the ranks to lay out (default: --nnodes x this node's GPUs; needed on CPU)",
    )


def _output_and_checkpoints(p) -> None:
    d = _default
    switch = dict(action="store_const", const=True)
    p.add_argument(
        "--output-dir",
        metavar="DIR",
        help=f"where metrics.jsonl, config.yaml, TensorBoard logs and checkpoints go ({d('output_dir')})",
    )
    p.add_argument("--overwrite", **switch, help="write into an output dir that already holds a run (default: refuse)")
    p.add_argument(
        "--log-every", type=int, metavar="N", help=f"optimizer steps between metrics records ({d('log_every')})"
    )
    p.add_argument(
        "--save-every",
        type=int,
        metavar="N",
        help="optimizer steps between checkpoints in OUTPUT_DIR/checkpoints; 0: none, except a final one for "
        f"--export-on-finish ({d('save_every')})",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        metavar="K",
        help=f"keep only the newest K checkpoints; 0 keeps all ({d('keep_checkpoints')})",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        metavar="SECONDS",
        help="after set-up, a rank that waits this long in a collective for another rank (hung, stopped, its "
        f"node gone) stops the run with a line naming the step and the rank ({d('collective_timeout')})",
    )
    p.add_argument(
        "--resume",
        **switch,
        help="continue from the newest complete checkpoint in --output-dir, on any mesh with the same global "
        "batch (default: start from step 0)",
    )
    p.add_argument(
        "--export-on-finish",
        **switch,
        help="save a final checkpoint and export it to OUTPUT_DIR/export, a from_pretrained folder (default: off)",
    )


def _speed_and_parallelism(p) -> None:
    switch = dict(action="store_const", const=True)
    p.add_argument(
        "--activation-checkpointing",
        **switch,
        help="recompute each decoder layer in the backward: less memory, more compute (default: off)",
    )
    p.add_argument("--compile", **switch, help="torch.compile each decoder layer (default: off)")
    p.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32"],
        help="compute dtype; bf16 keeps fp32 master weights and reductions (default auto: bf16 on GPUs, fp32 on CPU)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help="where the ranks run (default auto: one GPU per rank if CUDA is visible, else CPU; the embedded default runs on CPU)",
    )
    p.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_const",
        const=False,
        help="tensor parallel without sequence parallel: norms run on the whole sequence (default: sequence parallel)",
    )
    p.add_argument(
        "--no-loss-parallel",
        dest="loss_parallel",
        action="store_const",
        const=False,
        help="replicated instead of vocab-sharded logits, only for models whose lm_head and loss are not fused "
        "(default: vocab-sharded)",
    )
    p.add_argument(
        "--profile-steps",
        metavar="A-B",
        help="profile optimizer steps A-B (e.g. 10-12): Perfetto trace and op table in OUTPUT_DIR/profile "
        "(default: off)",
    )
    p.add_argument(
        "--report-to",
        metavar="WHERE",
        help="where metrics go besides metrics.jsonl and the progress bar: tensorboard (OUTPUT_DIR/tensorboard), "
        "wandb (pip install wandb; WANDB_MODE=offline works without an account), tensorboard,wandb, or none "
        f"({_default('report_to')})",
    )
    p.add_argument(
        "--no-tensorboard",
        dest="report_to",
        action="store_const",
        const="none",
        help="the same as --report-to none (default: off)",
    )


def _launch(p) -> None:
    d = _default
    p.add_argument("--nnodes", type=int, metavar="N", help=f"nodes; run the same command on each ({d('nnodes')})")
    p.add_argument("--node-rank", type=int, metavar="I", help=f"this node's index, 0 to nnodes-1 ({d('node_rank')})")
    p.add_argument("--master-addr", metavar="HOST", help=f"address of node 0 for the rendezvous ({d('master_addr')})")
    p.add_argument(
        "--master-port",
        type=int,
        metavar="PORT",
        help="port on node 0 (default: a free port; set it for several nodes)",
    )
    p.add_argument(
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
    from hf_tp.demo import with_embedded_default
    from hf_tp.train.launch import launch, start_line

    in_rank = "WORLD_SIZE" in os.environ
    try:
        cfg = config_from_args(args)
        check_request(cfg)
        cfg.resolve().validate()  # the numbers alone, before torch is imported
        from hf_tp.train.validate import device_type as find_device_type
        from hf_tp.train.validate import load_model_config, prelaunch_checks

        cfg = with_embedded_default(cfg)
        if cfg.layout == "auto":
            cfg = auto_layout(cfg, load_model_config(cfg.model, cfg.trust_remote_code))
        device_type = find_device_type(cfg) if in_rank else prelaunch_checks(cfg)
    except ValueError as exc:
        print(f"hf-tp train: error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0" and not os.environ.get("HF_TP_LAUNCHED"):
        print(start_line(cfg, device_type, launching=not in_rank and cfg.world_size > 1), flush=True)
    if not in_rank and cfg.world_size > 1:
        if warning := oversubscribed(cfg, device_type):
            print(f"hf-tp train: warning: {warning}", file=sys.stderr, flush=True)
        # The ranks read their settings from a file of the launch's own; the run's config.yaml is
        # written by rank 0 once the run is accepted (hf_tp.train.run_dir).
        return launch(cfg, verbose=args.verbose)
    from hf_tp.train.distributed import shutdown
    from hf_tp.train.errors import report_rank_error
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
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        return code
    shutdown()
    if result.preempted_at is not None:
        from hf_tp.train.faults import EXIT_PREEMPTED

        return EXIT_PREEMPTED  # a requeue script's cue (scripts/slurm_train.sh)
    return 0


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


def main(argv: list[str] | None = None) -> int:
    p = subcommand_parser("hf-tp train", DESCRIPTION, EPILOG)
    add_arguments(p)
    return run(p.parse_args(argv))
