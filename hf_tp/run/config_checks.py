"""The checks of a training run's settings that need nothing but the numbers (the model's are
checked on load), mixed into ``TrainConfig``: each refusal is one line naming the flag."""

from __future__ import annotations

import math

from hf_tp.core.dims import check_compile, check_layout, check_pipeline_dims, check_pipeline_rows, check_positive
from hf_tp.core.setting import is_a, type_words
from hf_tp.data.columns import STANDARD as STANDARD_COLUMNS
from hf_tp.gpus import get_gpu
from hf_tp.run.settings_data import OBJECTIVES
from hf_tp.run.settings_run import AUX_LOSS_OVER, DEVICES, DTYPES, LAYOUTS, REPORTERS


def parse_profile_steps(spec: str | None) -> tuple[int, int] | None:
    """``"A-B"`` (or ``"A"``) -> (A, B), 1-based and inclusive; A >= 2 leaves a warm-up step."""
    if spec is None or spec == "":
        return None
    first, _, last = str(spec).partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"--profile-steps must look like 10-12 (optimizer steps, inclusive), got {spec!r}") from None
    if not 2 <= a <= b:
        raise ValueError(
            f"--profile-steps {spec}: need 2 <= first <= last (step first-1 is the profiler's warm-up), got {a}-{b}"
        )
    return a, b


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


class ConfigChecks:
    """``validate`` and its parts; the fields and properties they read are ``TrainConfig``'s."""

    def validate(self) -> None:
        """Checks that need nothing but the numbers (the model's are checked on load)."""
        self._validate_types()
        check_layout(self.tp, self.dp, self.cp, self.ep, self.dp_replicate, flags=True)
        self._validate_auto_layout()
        check_compile(self.compile, self.activation_checkpointing, self.tp or 1)
        for name in (
            "pp",
            "pp_virtual_stages",
            "seq_len",
            "batch_size",
            "grad_accum",
            "max_steps",
            "log_every",
            "nnodes",
        ):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name), flags=True)
        if self.seq_len == 1:  # (0 and below: check_positive's line)
            raise ValueError(
                "--seq-len must be at least 2: the loss predicts each token from the ones before it, and a "
                "1-token sequence has none to predict; got 1"
            )
        self._validate_pipeline()
        self._validate_objective()
        if self.aux_loss_over not in AUX_LOSS_OVER:
            raise ValueError(f"--aux-loss-over must be one of {', '.join(AUX_LOSS_OVER)}, got {self.aux_loss_over!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        for name in ("save_every", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.collective_timeout > 0:
            raise ValueError(
                f"--collective-timeout must be a positive number of seconds, got {self.collective_timeout}"
            )
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        self._validate_data()
        self._validate_lora()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        profiled = parse_profile_steps(self.profile_steps)
        if profiled and self.max_steps is not None and profiled[1] > self.max_steps:
            raise ValueError(f"--profile-steps {self.profile_steps} goes past --max-steps {self.max_steps}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be a port number, 1-65535, got {self.master_port}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.tp is not None and self.dp is not None and self.world_size % self.nnodes:
            raise ValueError(
                f"{self.layout_name} ({self.world_size}) processes cannot be split evenly over --nnodes {self.nnodes}"
            )

    def _validate_pipeline(self) -> None:
        """The pipeline settings (:func:`hf_tp.core.dims.check_pipeline_dims`), the rows split evenly
        into micro-batches, and the combinations not exact with pipeline stages yet."""
        check_pipeline_dims(self.pp, self.pp_schedule, self.microbatches, self.pp_virtual_stages, flags=True)
        if self.pp == 1:
            return
        check_pipeline_rows(self.batch_size, self.pipeline_microbatches)
        refused = {
            "--compile": self.compile,
            "--train-vision-tower": self.train_vision_tower,
        }
        for flag, on in refused.items():
            if on:
                raise ValueError(f"--pp does not combine with {flag} yet: drop one (or train with --pp 1)")
        if self.objective != "sft" and (self.eval_split or self.eval_dataset):
            raise ValueError(
                f"--pp with --objective {self.objective} does not evaluate held-out pairs yet: "
                "drop --eval-split / --eval-dataset (or train with --pp 1)"
            )

    def _validate_auto_layout(self) -> None:
        """``--layout auto`` chooses tp, dp, pp and HSDP itself, of ``--world`` ranks;
        ``--gpu`` and ``--world`` mean nothing without it."""
        if self.layout not in LAYOUTS:
            raise ValueError(f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.world is not None:
            check_positive("world", self.world, flags=True)
        if self.gpu is not None:
            get_gpu(self.gpu)
        if self.layout == "manual":
            if self.gpu is not None or self.world is not None:
                raise ValueError("--gpu and --world choose a layout: add --layout auto (or drop them)")
            return
        given = [f for f, on in (("--pp", self.pp > 1), ("--dp-replicate", self.dp_replicate > 1)) if on]
        if given:
            raise ValueError(
                f"--layout auto chooses --pp and --dp-replicate itself (with --gpu, across nodes): drop {' and '.join(given)} "
                "(or drop --layout auto)"
            )

    def _validate_types(self) -> None:
        """Every field holds its type (a ``TrainConfig`` built in Python skips YAML's conversion),
        and every number is finite: ``--lr inf`` would train to NaN, ``nan`` compares false."""
        for name, allowed in self.field_types().items():
            value = getattr(self, name)
            if value is None:
                continue
            if not is_a(value, allowed):
                raise ValueError(f"{_flag(name)} must be {type_words(allowed)}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{_flag(name)} must be a finite number, got {value}")

    def _validate_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if not self.beta > 0:
            raise ValueError(f"--beta must be positive, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.precompute_ref and self.objective != "dpo":
            raise ValueError(f"--precompute-ref is for --objective dpo (its reference model), not {self.objective}")
        if self.precompute_ref and self.has_eval:
            raise ValueError("--precompute-ref scores the training pairs only; drop --eval-dataset / --eval-split")
        if self.objective == "sft":
            return
        if self.pack:
            raise ValueError(
                f"--objective {self.objective} does not pack pairs (each side is one padded row, so a pair stays in "
                "one micro-batch and sees no other document): drop --pack / pack: true"
            )
        if self.streaming:
            raise ValueError(f"--objective {self.objective} reads whole pairs: drop --streaming")

    def _validate_lora(self) -> None:
        if not isinstance(self.lora_r, int) or isinstance(self.lora_r, bool) or self.lora_r < 0:
            raise ValueError(f"--lora-r must be a non-negative integer (0: train every weight), got {self.lora_r!r}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.lora_targets():
            raise ValueError("--lora-target-modules is empty; use all-linear or names such as q_proj,v_proj")
        if not self.lora_r and (self.lora_alpha is not None or self.lora_dropout):
            raise ValueError("--lora-alpha/--lora-dropout need --lora-r R (the LoRA rank)")

    def _validate_data(self) -> None:
        if not 0 <= self.eval_split < 1:
            raise ValueError(
                f"--eval-split must be a fraction in [0, 1) of the training documents, got {self.eval_split}"
            )
        if self.eval_split and self.eval_dataset:
            raise ValueError("pass either --eval-dataset or --eval-split (a held-out fraction), not both")
        for name in ("eval_every", "eval_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if (self.eval_every or self.eval_batches) and not self.has_eval:
            raise ValueError("--eval-every/--eval-batches need evaluation data: pass --eval-dataset or --eval-split")
        if self.streaming and (self.eval_split or self.pack is False):
            raise ValueError(
                "--streaming packs documents as it reads them: it takes neither --no-pack nor --eval-split "
                "(use --eval-dataset)"
            )
        if self.text_column and self.messages_column:
            raise ValueError("pass either --text-column or --messages-column, not both")
        named = [c for c in (getattr(self, f"{n}_column") for n in STANDARD_COLUMNS) if c]
        if len(set(named)) < len(named):
            twice = next(c for c in named if named.count(c) > 1)
            raise ValueError(
                f"two of --prompt-column, --chosen-column, --rejected-column, --tools-column name column '{twice}'; "
                "each must name its own"
            )
        names = [n.strip() for n in str(self.report_to).split(",")]
        if set(names) - set(REPORTERS) or ("none" in names and len(names) > 1):
            raise ValueError(f"--report-to takes {', '.join(REPORTERS)} (or tensorboard,wandb), got {self.report_to!r}")
