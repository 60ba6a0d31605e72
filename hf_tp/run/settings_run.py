"""The settings of how a run goes: sizes and optimizer, output and checkpoints, speed and
parallelism, the launch. Each group is one flag group of ``hf-tp train --help``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hf_tp.core.dims import ParallelDims
from hf_tp.core.setting import setting, settings_group

DTYPES = ("auto", "bf16", "fp32")
REPORTERS = ("tensorboard", "wandb", "none")
DEVICES = ("auto", "cpu", "cuda")
LAYOUTS = ("manual", "auto")
AUX_LOSS_OVER = ("step", "micro-batch")
MIN_LR_RATIO = 0.1


@dataclass
class SizesAndOptimizer:
    TITLE: ClassVar[str] = "sizes and optimizer"

    layout: str = setting(
        "manual",
        "auto: choose --tp, --dp and activation checkpointing for --world ranks before launch: with --gpu "
        "the fastest layout the estimate predicts that fits that GPU, else the largest tp the model allows",
        choices=LAYOUTS,
    )
    gpu: str | None = setting(None, "with --layout auto: the GPU to plan for, as hf-tp estimate --gpu", metavar="NAME")
    world: int | None = setting(
        None,
        "with --layout auto: the ranks to lay out (default: --nnodes x this node's GPUs; needed on CPU)",
        metavar="N",
    )
    predicted_speed: float | None = setting(
        None, "tokens/s of all ranks that --layout auto --gpu predicts; logged as predicted_tokens_per_sec", names=None
    )
    predicted_mfu: float | None = setting(None, "the MFU --layout auto --gpu predicts; logged beside mfu", names=None)
    batch_size: int | None = setting(
        None,
        "sequences per dp rank per micro-step; the global batch is batch x dp x grad-accum",
        metavar="N",
    )
    grad_accum: int = setting(1, "micro-steps per optimizer step", metavar="N")
    max_steps: int | None = setting(None, "optimizer steps", metavar="N")
    lr: float | None = setting(None, "peak learning rate of AdamW, betas 0.9/0.95")
    min_lr_ratio: float = setting(MIN_LR_RATIO, "the fraction of lr the cosine decay ends at", names=None)
    warmup_steps: int | None = setting(
        None,
        "linear warmup from lr/(N+1) at the first step to lr at step N+1, then cosine decay to "
        f"{MIN_LR_RATIO:g} x lr at --max-steps",
        metavar="N",
    )
    weight_decay: float = setting(0.1, "AdamW weight decay", metavar="W")
    max_grad_norm: float = setting(1.0, "clip the global gradient norm to X; 0 disables", metavar="X")
    aux_loss_over: str = setting(
        "step",
        "MoE router aux loss under --grad-accum: over the whole step's tokens, as one device computes it "
        "on the global batch (one extra forward without gradients per micro-batch), or over each micro-batch "
        "as the HF Trainer does",
        choices=AUX_LOSS_OVER,
    )
    seed: int = setting(0, "seed of the data order and of random init")
    lora_r: int = setting(
        0,
        "train LoRA adapters of rank R on a frozen base (peft; pip install hf_tp[lora]); 0: every weight",
        metavar="R",
    )
    lora_alpha: float | None = setting(None, "LoRA scaling alpha / r (default: 2 x r)", metavar="A")
    lora_dropout: float = setting(0.0, "dropout on the LoRA input", metavar="P")
    lora_target_modules: str = setting(
        "all-linear", "all-linear or comma-separated projection names, e.g. q_proj,v_proj", metavar="NAMES"
    )


# tp, dp, ep, cp, dp_replicate, pp and the schedule: one group, declared once on
# hf_tp.core.dims.ParallelDims; in --help the sizes open "sizes and optimizer", the pipeline's
# flags have their own group. Unset tp and dp here: a profile fills them (hf_tp.run.config),
# or --layout auto chooses them.
Parallelism = settings_group(
    ParallelDims,
    "sizes and optimizer",
    __name__,
    dict.fromkeys(
        ("pp", "pp_schedule", "microbatches", "pp_virtual_stages"), "pipeline parallelism (docs/training.md)"
    ),
    tp=None,
    dp=None,
)


@dataclass
class OutputAndCheckpoints:
    TITLE: ClassVar[str] = "output and checkpoints"

    output_dir: str = setting(
        "outputs/run", "where metrics.jsonl, config.yaml, TensorBoard logs and checkpoints go", metavar="DIR"
    )
    overwrite: bool = setting(False, "write into an output dir that already holds a run (default: refuse)")
    log_every: int = setting(1, "optimizer steps between metrics records", metavar="N")
    save_every: int = setting(
        0,
        "optimizer steps between checkpoints in OUTPUT_DIR/checkpoints; 0: none, except a final one for "
        "--export-on-finish",
        metavar="N",
    )
    keep_checkpoints: int = setting(0, "keep only the newest K checkpoints; 0 keeps all", metavar="K")
    collective_timeout: float = setting(
        600.0,
        "after set-up, a rank that waits this long in a collective for another rank (hung, stopped, its "
        "node gone) stops the run with a line naming the step and the rank",
        metavar="SECONDS",
    )
    resume: bool = setting(
        False,
        "continue from the newest complete checkpoint in --output-dir, on any mesh with the same global "
        "batch (default: start from step 0)",
    )
    export_on_finish: bool = setting(
        False,
        "save a final checkpoint and export it to OUTPUT_DIR/export, a from_pretrained folder (default: off)",
    )


@dataclass
class SpeedAndParallelism:
    TITLE: ClassVar[str] = "speed, precision and parallelism"

    activation_checkpointing: bool = setting(
        False, "recompute each decoder layer in the backward: less memory, more compute (default: off)"
    )
    compile: bool = setting(False, "torch.compile each decoder layer (default: off)")
    dtype: str = setting(
        "auto",
        "compute dtype; bf16 keeps fp32 master weights and reductions (default auto: bf16 on GPUs, fp32 on CPU)",
        choices=DTYPES,
    )
    device: str = setting(
        "auto",
        "where the ranks run (default auto: one GPU per rank if CUDA is visible, else CPU; the embedded "
        "default runs on CPU)",
        choices=DEVICES,
    )
    sequence_parallel: bool = setting(
        True,
        no_help="tensor parallel without sequence parallel: norms run on the whole sequence (default: sequence "
        "parallel)",
    )
    loss_parallel: bool = setting(
        True,
        no_help="replicated instead of vocab-sharded logits, only for models whose lm_head and loss are not "
        "fused (default: vocab-sharded)",
    )
    profile_steps: str | None = setting(
        None,
        "profile optimizer steps A-B (e.g. 10-12): Perfetto trace and op table in OUTPUT_DIR/profile (default: off)",
        metavar="A-B",
    )
    report_to: str = setting(
        "tensorboard",
        "where metrics go besides metrics.jsonl and the progress bar: tensorboard (OUTPUT_DIR/tensorboard), "
        "wandb (pip install wandb; WANDB_MODE=offline works without an account), tensorboard,wandb, or none",
        metavar="WHERE",
        presets=(("--no-tensorboard", "none", "the same as --report-to none (default: off)"),),
    )


@dataclass
class Launch:
    TITLE: ClassVar[str] = "launch (several nodes)"

    nnodes: int = setting(1, "nodes; run the same command on each", metavar="N")
    node_rank: int = setting(0, "this node's index, 0 to nnodes-1", metavar="I")
    master_addr: str = setting("127.0.0.1", "address of node 0 for the rendezvous", metavar="HOST")
    master_port: int | None = setting(
        None, "port on node 0 (default: a free port; set it for several nodes)", metavar="PORT"
    )
