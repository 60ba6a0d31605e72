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

# Dense bf16 peak FLOP/s per GPU (vendor data sheets), for MFU; unknown devices report no MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}


def flops_per_token(model_config, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's formula as torchtitan reports it: 6N + 12 L H S.

    N counts the parameters that take part in matrix products: all but the input embedding (a
    lookup). ``num_params`` counts a tied embedding/lm_head matrix once; it still does the output
    projection, so it is added back (otherwise a tied model's MFU would omit its lm_head, about
    a third of Qwen2-0.5B's work).
    """
    model_config = getattr(model_config, "text_config", None) or model_config  # a multimodal wrapper's language model
    embed = model_config.vocab_size * model_config.hidden_size
    n = num_params - embed
    if getattr(model_config, "tie_word_embeddings", False):
        n += embed
    return 6 * n + 12 * model_config.num_hidden_layers * model_config.hidden_size * seq_len


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


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
        # aside with --overwrite, a resumed run's stale records set aside; hf_tp.train.run_dir).
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
