"""``TrainConfig``: every setting of a training run, from defaults < YAML < CLI flags."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from hf_tp.gpus import get_gpu
from hf_tp.layout import check_layout, check_positive, row_multiple

DTYPES = ("auto", "bf16", "fp32")
REPORTERS = ("tensorboard", "wandb", "none")
DEVICES = ("auto", "cpu", "cuda")
LAYOUTS = ("manual", "auto")
AUX_LOSS_OVER = ("step", "micro-batch")
OBJECTIVES = ("sft", "dpo", "simpo")  # cross entropy; preference losses on pairs (hf_tp.objectives)


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


@dataclass
class TrainConfig:
    """A training run. ``None`` means "not set": :meth:`resolve` fills it from a profile.

    Sizes: ``batch_size`` is sequences per dp rank per micro-step, so the global batch is
    ``batch_size * dp * grad_accum`` sequences; it alone (with the seed) decides the data of a step.
    """

    # model and data
    model: str | None = None  # Hub id or local dir; None: the embedded tiny Llama
    trust_remote_code: bool = False  # run the Python code a model repo ships (auto_map); off: such models are refused
    dataset: str | None = None  # Hub id, local file or dir; None: the embedded generated corpus
    dataset_config: str | None = None  # the Hub dataset's configuration (load_dataset's name)
    split: str = "train"  # split of the dataset, slices included ("train[:5%]")
    text_column: str | None = None  # None: detected ("text", else "messages" chat, else prompt/completion)
    messages_column: str | None = None  # a column of role/content conversations (chat data)
    assistant_only_loss: bool = True  # chat / prompt-completion: targets only in assistant turns / completion
    seq_len: int | None = None
    pack: bool = True  # pack documents into seq_len blocks (pretraining) or pad each one
    document_masking: bool = True  # packed documents attend only to themselves (position_ids restart)
    streaming: bool = False  # read the dataset as an IterableDataset, tokenize and pack on the fly
    skip_bad_rows: bool = False  # drop malformed rows (reported once) instead of stopping before launch
    train_vision_tower: bool = False  # a multimodal checkpoint's vision tower trains too (default: frozen)
    # held-out evaluation
    eval_dataset: str | None = None  # Hub id, local file or dir, read like the training data
    eval_dataset_split: str = "train"
    eval_split: float = 0.0  # hold out this fraction of the training documents (seeded) instead
    eval_every: int = 0  # optimizer steps between evaluations; 0: only at the end
    eval_batches: int = 0  # global batches per evaluation; 0: the whole eval set
    # parallelism
    tp: int | None = None
    dp: int | None = None
    ep: int = 1  # expert parallelism (MoE models): ranks borrowed from dp that split the experts
    cp: int = 1  # context parallelism: each row's tokens split over cp ranks (long sequences)
    dp_replicate: int = 1  # HSDP: dp = dp_replicate replicas x an FSDP2 group of dp / dp_replicate ranks
    layout: str = "manual"  # "auto": hf-tp train chooses tp, dp (and activation checkpointing) before launch
    gpu: str | None = None  # --layout auto: rank layouts by the estimate's predicted speed on this GPU (hf_tp.gpus)
    world: int | None = None  # --layout auto: the ranks to lay out (default: --nnodes x this node's GPUs)
    predicted_speed: float | None = (
        None  # tokens/s, all ranks: set by --layout auto --gpu, logged as predicted_tokens_per_sec
    )
    predicted_mfu: float | None = None  # set by --layout auto --gpu; logged beside mfu
    sequence_parallel: bool = True
    loss_parallel: bool = True
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each decoder layer
    device: str = "auto"
    dtype: str = "auto"  # bf16 on GPU, fp32 on CPU
    # LoRA (peft): lora_r > 0 freezes the base and trains LoRA adapters (pip install hf_tp[lora])
    lora_r: int = 0
    lora_alpha: float | None = None  # scaling is alpha / r; None: 2 x r
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"  # "all-linear" or comma-separated module names
    # optimisation
    batch_size: int | None = None
    grad_accum: int = 1
    max_steps: int | None = None
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    # the objective: next-token cross entropy (sft) or a preference loss on prompt/chosen/rejected pairs
    objective: str = "sft"  # sft, dpo (against a reference model) or simpo (reference-free)
    beta: float = 0.1  # DPO / SimPO temperature (TRL's beta)
    label_smoothing: float = 0.0  # DPO / SimPO: the probability that a pair's preference is flipped (cDPO)
    simpo_gamma: float = 0.5  # SimPO's target reward margin (TRL's simpo_gamma)
    precompute_ref: bool = False  # dpo: reference log-probs in one pass before training, the reference freed
    aux_loss_over: str = "step"  # MoE aux loss with --grad-accum: "step" (exact, one extra forward) or "micro-batch"
    seed: int = 0
    # checkpoints
    save_every: int = 0  # optimizer steps between checkpoints; 0: only a final one if exporting
    keep_checkpoints: int = 0  # keep the newest K complete checkpoints; 0: keep all
    resume: bool = False  # continue from the newest complete checkpoint in output_dir
    export_on_finish: bool = False  # write OUTPUT_DIR/export (HF safetensors folder) at the end
    collective_timeout: float = 600.0  # seconds a rank waits in a collective for the others (after set-up)
    # output
    output_dir: str = "outputs/run"
    overwrite: bool = False
    log_every: int = 1
    report_to: str = "tensorboard"  # tensorboard, wandb, both comma-separated, or none
    profile_steps: str | None = None  # "A-B": torch.profiler trace of optimizer steps A..B in output_dir/profile
    # launch (multi-node flags pass through to accelerate's launcher)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def field_types(cls) -> dict[str, tuple[type, ...]]:
        """Each field's value types (``None`` left out): ``int | None`` -> ``(int,)``."""
        hints = typing.get_type_hints(cls)
        out = {}
        for f in fields(cls):
            hint = hints[f.name]
            args = (
                typing.get_args(hint)
                if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
                else (hint,)
            )
            out[f.name] = tuple(a for a in args if a is not type(None))
        return out

    @classmethod
    def from_yaml(cls, path: str | Path) -> dict[str, Any]:
        """The settings in a YAML file (keys as the CLI flags, ``-`` or ``_``), checked by name and
        converted to each field's type (:func:`coerce_setting`)."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            where = getattr(exc, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            raise ValueError(
                f"config file {p} is not valid YAML{line}: {getattr(exc, 'problem', None) or exc}"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {p} must hold a mapping of settings, got {type(data).__name__}")
        data = {str(k).replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown settings in {p}: {', '.join(unknown)}; valid: {', '.join(cls.field_names())}")
        types_ = cls.field_types()
        return {k: coerce_setting(k, v, types_[k], f"config file {p}") for k, v in data.items()}

    def resolve(self) -> TrainConfig:
        """Fill unset fields: the embedded-default profile without --model, the general one with."""
        profile = EMBEDDED_PROFILE if self.model is None else GENERAL_PROFILE
        chosen = ("tp", "dp") if self.layout == "auto" else ()  # --layout auto fills them (hf_tp.cli.auto_layout)
        values = {k: (profile[k] if getattr(self, k) is None else getattr(self, k)) for k in profile if k not in chosen}
        if self.model is None and self.device == "auto":
            values["device"] = "cpu"  # the tiny default gains nothing from a GPU
        return dataclasses.replace(self, **values)

    def validate(self) -> None:
        """Checks that need nothing but the numbers (the model's are checked on load)."""
        self._validate_types()
        check_layout(self.tp, self.dp, self.cp, self.ep, self.dp_replicate, flags=True)
        self._validate_auto_layout()
        for name in (
            "seq_len",
            "batch_size",
            "grad_accum",
            "max_steps",
            "log_every",
            "nnodes",
        ):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name), flags=True)
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
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.tp is not None and self.dp is not None and self.world_size % self.nnodes:
            raise ValueError(
                f"{self.layout_name} ({self.world_size}) processes cannot be split evenly over --nnodes {self.nnodes}"
            )

    def _validate_auto_layout(self) -> None:
        """``--layout auto`` chooses tp and dp itself, of ``--world`` ranks (HSDP not among its choices);
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
        if self.dp_replicate > 1:
            raise ValueError("--layout auto does not choose HSDP layouts: drop --dp-replicate or --layout auto")

    def _validate_types(self) -> None:
        """Every field holds its type (a ``TrainConfig`` built in Python skips YAML's conversion),
        and every number is finite: ``--lr inf`` would train to NaN, ``nan`` compares false."""
        for name, allowed in self.field_types().items():
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_a(value, allowed):
                want = " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in allowed)
                raise ValueError(f"{_flag(name)} must be {want}, got {value!r}")
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

    def lora_targets(self) -> str | list[str]:
        """peft's ``target_modules``: ``"all-linear"`` or the list of names."""
        if self.lora_target_modules.strip() == "all-linear":
            return "all-linear"
        return [t.strip() for t in self.lora_target_modules.split(",") if t.strip()]

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
        if self.streaming and (self.eval_split or not self.pack):
            raise ValueError(
                "--streaming packs documents as it reads them: it takes neither --no-pack nor --eval-split "
                "(use --eval-dataset)"
            )
        if self.text_column and self.messages_column:
            raise ValueError("pass either --text-column or --messages-column, not both")
        names = [n.strip() for n in str(self.report_to).split(",")]
        if set(names) - set(REPORTERS) or ("none" in names and len(names) > 1):
            raise ValueError(f"--report-to takes {', '.join(REPORTERS)} (or tensorboard,wandb), got {self.report_to!r}")

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_dataset or self.eval_split)

    @property
    def reporters(self) -> tuple[str, ...]:
        """``report_to`` as names, without "none"."""
        return tuple(n.strip() for n in str(self.report_to).split(",") if n.strip() not in ("", "none"))

    def compute_dtype_name(self, device_type: str) -> str:
        """ "bf16" on GPUs unless ``--dtype fp32``; "fp32" on CPU unless ``--dtype bf16``."""
        return "bf16" if self.dtype == "bf16" or (self.dtype == "auto" and device_type == "cuda") else "fp32"

    @property
    def world_size(self) -> int:
        return (self.tp or 1) * self.cp * (self.dp or 1)

    @property
    def layout_name(self) -> str:
        """ "tp*dp" or "tp*cp*dp": how the processes are counted, for messages."""
        return "tp*cp*dp" if self.cp > 1 else "tp*dp"

    @property
    def layout_sizes(self) -> str:
        """ "2*4" or "2*2*4": the sizes :attr:`layout_name` names, for messages."""
        sizes = (self.tp or 1, self.cp, self.dp or 1) if self.cp > 1 else (self.tp or 1, self.dp or 1)
        return "*".join(map(str, sizes))

    @property
    def row_multiple(self) -> int:
        """Rows are padded to a multiple of this: tp (sequence parallelism), 2 x cp x tp with
        context parallelism (each cp rank keeps two equal chunks, each split over tp)."""
        return row_multiple(self.tp or 1, self.cp)

    @property
    def global_batch(self) -> int:
        return (self.batch_size or 1) * (self.dp or 1) * self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


# Without --model: the tiny Llama and generated corpus, sized so the loss falls in about a minute.
EMBEDDED_PROFILE: dict[str, Any] = dict(seq_len=64, tp=2, dp=2, batch_size=4, max_steps=120, lr=3e-3, warmup_steps=10)
# With --model: conservative fine-tuning/pretraining defaults.
GENERAL_PROFILE: dict[str, Any] = dict(
    seq_len=2048, tp=1, dp=1, batch_size=1, max_steps=1000, lr=3e-4, warmup_steps=100
)


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _is_a(value: object, allowed: tuple[type, ...]) -> bool:
    """``isinstance`` where a bool is no integer and an integer is a float."""
    if isinstance(value, bool):
        return bool in allowed
    return any(isinstance(value, t) or (t is float and isinstance(value, int)) for t in allowed)


def coerce_setting(name: str, value: Any, allowed: tuple[type, ...], where: str) -> Any:
    """A YAML value converted to a field's type, or one line naming the key.

    PyYAML follows YAML 1.1, where ``1e-3`` and ``3e4`` (no dot) are strings, not numbers;
    numbers, and strings that spell one, become the field's int or float (an int only when whole:
    ``3e4`` -> 30000, ``2.5`` is refused for an integer). ``yes``/``true`` are already booleans;
    a list of names is the comma-separated string the flag takes (``report_to``, LoRA targets)."""
    if value is None or (isinstance(value, bool) and bool in allowed):
        return value
    if str in allowed:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return ",".join(value)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. profile_steps: 10
    elif isinstance(value, int) and not isinstance(value, bool):
        return value if int in allowed else float(value)
    elif isinstance(value, (str, float)):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and int in allowed and number.is_integer():
            return int(number)
        if number is not None and float in allowed:
            return number
    want = " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in allowed)
    raise ValueError(f"{where}: {name} must be {want}, got {value!r}")


def merge(base: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """``base`` with ``overrides`` (only keys whose value is not None) applied."""
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
