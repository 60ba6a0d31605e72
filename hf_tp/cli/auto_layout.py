"""``hf-tp train --layout auto``: tp, dp, pipeline stages, HSDP and activation checkpointing chosen for a
number of ranks, before launch.

With ``--gpu NAME`` the estimate's sweep on that GPU (:func:`hf_tp.estimate.sweep.sweep`, the per-rank
batch kept at ``--batch-size``; ``--cp``, ``--ep`` and LoRA as given) picks the fastest layout that
fits, printed with its predicted peak memory and tokens/s and the runner-up; the prediction is
logged next to the measured tokens/s in metrics.jsonl. Across nodes the sweep also tries HSDP
(``--dp-replicate``) and pipeline layouts (``--pp`` with 1F1B or Interleaved 1F1B, ``--microbatches``
splitting ``--batch-size``; ``--cp`` and ``--ep`` inside each stage), unless the run uses what ``--pp``
does not combine with yet (--compile, a preference objective, a trained vision tower). Without ``--gpu`` (a CPU run, or no plan wanted) nothing is predicted: the largest
tp the model's heads and widths allow that divides the ranks, the rest dp. The chosen layout is
written into the run's settings (``--layout manual`` with its --tp, --dp, --pp, --pp-schedule,
--pp-virtual-stages, --microbatches and --dp-replicate, the prediction in ``predicted_speed`` and
``predicted_mfu``), so the ranks, config.yaml and a resume see it as given.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass

from hf_tp.run.config import TrainConfig


@dataclass(frozen=True)
class Choice:
    """One layout and, with a GPU named, what the estimate predicts for it."""

    tp: int
    dp: int
    cp: int = 1
    activation_checkpointing: bool = False
    peak_gib: float | None = None
    tokens_per_sec_per_gpu: float | None = None
    mfu: float | None = None
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    microbatches: int | None = None
    dp_replicate: int = 1

    def describe(self) -> str:
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        pp = ""
        if self.pp > 1:
            v = f" x {self.pp_virtual_stages} stages per rank" if self.pp_virtual_stages > 1 else ""
            pp = f"pp {self.pp} ({self.pp_schedule}{v}, {self.microbatches} micro-batches) x "
        hsdp = f" (HSDP: {self.dp_replicate} replicas)" if self.dp_replicate > 1 else ""
        text = f"{pp}tp {self.tp}{cp} x dp {self.dp}{hsdp}" + (
            ", activation checkpointing" if self.activation_checkpointing else ""
        )
        if self.tokens_per_sec_per_gpu is None:
            return text
        return (
            f"{text}: predicted peak {self.peak_gib:.1f} GiB per GPU, {self.tokens_per_sec_per_gpu:,.0f} tokens/s "
            f"per GPU, MFU {self.mfu:.1%}"
        )


def check_request(cfg: TrainConfig) -> None:
    """``--layout auto`` chooses --tp and --dp: giving them too is an error (called before the
    profiles fill them in)."""
    if cfg.layout == "auto" and (cfg.tp is not None or cfg.dp is not None):
        given = " and ".join(f for f, v in (("--tp", cfg.tp), ("--dp", cfg.dp)) if v is not None)
        raise ValueError(f"--layout auto chooses --tp and --dp: drop {given} (or drop --layout auto)")


def world_of(cfg: TrainConfig) -> int:
    """The ranks to lay out: torchrun's WORLD_SIZE in a rank, else ``--world``, else ``--nnodes`` x this node's GPUs."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if cfg.world is not None:
        return cfg.world
    import torch

    if cfg.device != "cpu" and torch.cuda.is_available():
        return cfg.nnodes * torch.cuda.device_count()
    raise ValueError("--layout auto on CPU needs --world N, the number of ranks to lay out")


def choose(cfg: TrainConfig, model_config, world: int, say) -> tuple[Choice, Choice | None]:
    """The chosen layout of ``world`` ranks and the runner-up (None if there is none)."""
    from hf_tp.estimate.sweep import cp_splits

    if cfg.gpu is None:
        splits = cp_splits(model_config, world, cfg.seq_len, cfg.ep, cfg.cp, [])  # smallest tp first
        ranked = [Choice(tp, dp, cfg.cp, cfg.activation_checkpointing) for tp, dp in reversed(splits)]
        return ranked[0], (ranked[1] if len(ranked) > 1 else None)
    from hf_tp.estimate.depth import default_jobs
    from hf_tp.estimate.spec import EstimateSpec
    from hf_tp.estimate.speed import Cluster
    from hf_tp.estimate.sweep import sweep
    from hf_tp.gpus import get_gpu

    spec = EstimateSpec(
        1, 1, cfg.seq_len, cfg.batch_size, "fp32" if cfg.dtype == "fp32" else "bf16", cfg.activation_checkpointing,
        cfg.ep, cfg.lora_r, cfg.lora_target_modules, cfg.cp,
    )  # fmt: skip
    # the layouts estimated from short runs, the two it prints then simulated at every layer (before
    # a launch: the full simulation, not the sweep's one-period check), on every core of this process
    cluster = Cluster(get_gpu(cfg.gpu))
    result = sweep(
        model_config, world, spec, progress=say, cluster=cluster, grow=False, verified=2, pp_schedules=_schedules(cfg),
        jobs=default_jobs(),
    )  # fmt: skip
    ranked = [
        Choice(
            e.tp,
            e.dp,
            e.cp,
            e.activation_checkpointing,
            e.peak.total / 2**30,
            s.tokens_per_second_per_gpu,
            s.mfu,
            e.pp,
            e.pp_schedule,
            e.pp_virtual_stages,
            e.microbatches if e.pp > 1 else None,
            e.dp_replicate,
        )  # fmt: skip
        for e, s in result.ranking()
    ]
    if not ranked:
        raise ValueError(
            f"no layout of {world} x {cfg.gpu} fits at --batch-size {cfg.batch_size} and --seq-len {cfg.seq_len} "
            "(hf-tp estimate --gpu shows each one's peak): try --activation-checkpointing, --lora-r, a smaller "
            "--batch-size or --seq-len, or more GPUs (--world)"
        )
    return ranked[0], (ranked[1] if len(ranked) > 1 else None)


def _schedules(cfg: TrainConfig) -> tuple[str, ...]:
    """The pipeline schedules the sweep tries for ``cfg``'s run: none where ``--pp`` does not combine
    with it yet (:meth:`hf_tp.run.config.TrainConfig.validate`), nor for a preference objective (the
    estimate does not price a pipelined reference); its ``--cp`` and ``--ep`` apply inside each
    stage (:mod:`hf_tp.estimate.sweep`)."""
    if cfg.compile or cfg.objective != "sft" or cfg.train_vision_tower:
        return ()
    return ("1f1b", "interleaved1f1b")


def apply(cfg: TrainConfig, choice: Choice, world: int) -> TrainConfig:
    """``cfg`` with the chosen layout, as if given by hand, and the prediction to log."""
    tokens = None if choice.tokens_per_sec_per_gpu is None else choice.tokens_per_sec_per_gpu * world
    return dataclasses.replace(
        cfg,
        tp=choice.tp,
        dp=choice.dp,
        activation_checkpointing=choice.activation_checkpointing,
        pp=choice.pp,
        pp_schedule=choice.pp_schedule,
        pp_virtual_stages=choice.pp_virtual_stages,
        microbatches=choice.microbatches,
        dp_replicate=choice.dp_replicate,
        layout="manual",
        gpu=None,
        world=None,
        predicted_speed=tokens,
        predicted_mfu=choice.mfu,
    )


def auto_layout(cfg: TrainConfig, model_config) -> TrainConfig:
    """Choose, print (rank 0) and apply the layout of ``--layout auto`` (see the module docstring)."""
    world = world_of(cfg)
    speaks = os.environ.get("RANK", "0") == "0"
    start = time.perf_counter()

    def say(message: str) -> None:
        if speaks:
            print(f"hf-tp train: [{time.perf_counter() - start:5.0f} s] {message} ...", file=sys.stderr, flush=True)

    best, runner = choose(cfg, model_config, world, say)
    if speaks:
        on = f"{world} x {cfg.gpu}" if cfg.gpu else f"{world} ranks (no --gpu: nothing predicted)"
        why = "" if cfg.gpu else ", the largest tp this model's heads and widths allow"
        print(f"hf-tp train: --layout auto on {on}: {best.describe()}{why}", flush=True)
        print(f"hf-tp train: runner-up: {runner.describe() if runner else 'none (no other layout fits)'}", flush=True)
    return apply(cfg, best, world)
