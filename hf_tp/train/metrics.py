"""Per-step metrics: metrics.jsonl, a tqdm bar and TensorBoard on rank 0; MFU and peak memory."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hf_tp.gpus import gpu_of_device


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense bf16 peak of this CUDA device from :data:`hf_tp.gpus.GPUS`, matched by its exact
    name; None on CPU, in fp32 or on a GPU the table does not list (no MFU is reported then)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    gpu = gpu_of_device(torch.cuda.get_device_name(device))
    return None if gpu is None else gpu.bf16_flops


def peak_memory_mib(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_rss_mib": kib / 1024}


class MetricsLogger:
    """Writes one JSON object per optimizer step (and per evaluation, marked ``"split": "eval"``)
    to metrics.jsonl, draws the progress bar, and reports to TensorBoard and/or Weights & Biases
    (``report_to``); only rank 0 writes or draws."""

    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        *,
        enabled: bool,
        report_to: tuple[str, ...] = ("tensorboard",),
        start_step: int = 0,
        run_config: dict[str, Any] | None = None,
    ):
        self.enabled = enabled
        self.file = None
        self.bar = None
        self.writer = None
        self.wandb = None
        self.postfix: dict[str, str] = {}
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        # Appended, never truncated: a run that reaches here owns the file (an earlier run was moved
        # aside with --overwrite, a resumed run's stale records set aside; hf_tp.run.run_dir).
        self.file = open(output_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("hf-tp: tensorboard is not installed; skipping TensorBoard logs", file=sys.stderr)
            else:
                self.writer = SummaryWriter(str(output_dir / "tensorboard"))
        if "wandb" in report_to:
            import wandb  # checked before launch: --report-to wandb needs it installed

            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "hf_tp"), dir=str(output_dir), config=run_config
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.postfix.update(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        for name, short in (("rewards/margins", "margin"), ("rewards/accuracies", "acc")):  # preference objectives
            if name in record:
                self.postfix[short] = f"{record[name]:.3f}"
        self._write(record, "train")
        self.bar.update(record["step"] - self.bar.n)

    def log_eval(self, record: dict[str, Any]) -> None:
        """An evaluation's record (``eval_loss``, ``eval_perplexity``, ...) after step ``record["step"]``."""
        if not self.enabled:
            return
        self.postfix["eval_loss"] = f"{record['eval_loss']:.4f}"
        self._write(record, "eval")
        self.bar.refresh()

    def _write(self, record: dict[str, Any], group: str) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.bar.set_postfix(self.postfix, refresh=False)
        scalars = {
            k.removeprefix("eval_"): v
            for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(f"{group}/{k}", v, record["step"])
        if self.wandb is not None:
            self.wandb.log({f"{group}/{k}": v for k, v in scalars.items()}, step=record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
