"""``TrainConfig``: every setting of a training run, from defaults < YAML < CLI flags.

The settings are declared once, in groups (``hf_tp.run.settings_data``, ``settings_run``), each
field with its help text and flags: ``hf-tp train``'s parser is generated from them
(``hf_tp.cli.train_flags``). ``TrainConfig`` is the flat public API over all of them."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from hf_tp.core.dims import ParallelDims, row_multiple
from hf_tp.core.setting import coerce_setting, value_types
from hf_tp.data.columns import STANDARD as STANDARD_COLUMNS
from hf_tp.data.columns import column_renames
from hf_tp.run.config_checks import ConfigChecks, parse_profile_steps
from hf_tp.run.settings_data import OBJECTIVES, HeldOutEval, ModelAndData, ObjectiveSettings
from hf_tp.run.settings_run import (
    AUX_LOSS_OVER,
    DEVICES,
    DTYPES,
    REPORTERS,
    Launch,
    OutputAndCheckpoints,
    Parallelism,
    SizesAndOptimizer,
    SpeedAndParallelism,
)

# The groups of settings, in the order of ``hf-tp train --help``; TrainConfig's fields follow it.
GROUPS = (
    ModelAndData,
    HeldOutEval,
    ObjectiveSettings,
    Parallelism,
    SizesAndOptimizer,
    OutputAndCheckpoints,
    SpeedAndParallelism,
    Launch,
)


# A dataclass takes its bases' fields in reverse MRO order: the last group listed comes first.
@dataclass
class TrainConfig(
    ConfigChecks,
    Launch,
    SpeedAndParallelism,
    OutputAndCheckpoints,
    SizesAndOptimizer,
    Parallelism,
    ObjectiveSettings,
    HeldOutEval,
    ModelAndData,
):
    """A training run. ``None`` means "not set": :meth:`resolve` fills it from a profile.

    Sizes: ``batch_size`` is sequences per dp rank per micro-step, so the global batch is
    ``batch_size * dp * grad_accum`` sequences; it alone (with the seed) decides the data of a step.
    """

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def field_types(cls) -> dict[str, tuple[type, ...]]:
        """Each field's value types (``None`` left out): ``int | None`` -> ``(int,)``."""
        hints = typing.get_type_hints(cls)
        return {f.name: value_types(hints[f.name]) for f in fields(cls)}

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

    def lora_targets(self) -> str | list[str]:
        """peft's ``target_modules``: ``"all-linear"`` or the list of names."""
        if self.lora_target_modules.strip() == "all-linear":
            return "all-linear"
        return [t.strip() for t in self.lora_target_modules.split(",") if t.strip()]

    @property
    def column_renames(self) -> dict[str, str]:
        """The dataset's columns that the ``--{prompt,chosen,rejected,tools}-column`` flags name, and
        the names the formats read them as (:mod:`hf_tp.data.columns`)."""
        return column_renames({n: getattr(self, f"{n}_column") for n in STANDARD_COLUMNS})

    @property
    def packs(self) -> bool:
        """Whether documents are packed: ``pack`` as given, else yes for cross entropy and no for
        preference pairs (which are padded, a pair side a row)."""
        return self.pack if self.pack is not None else self.objective == "sft"

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
    def dims(self) -> ParallelDims:
        """The run's parallel layout (tp or dp unset: 1), checked as :class:`ParallelDims` checks it."""
        return ParallelDims.of(self)

    @property
    def world_size(self) -> int:
        return self.pp * (self.tp or 1) * self.cp * (self.dp or 1)

    @property
    def layout_name(self) -> str:
        """ "tp*dp", "tp*cp*dp" or "pp*tp*dp": how the processes are counted, for messages."""
        return ("pp*" if self.pp > 1 else "") + ("tp*cp*dp" if self.cp > 1 else "tp*dp")

    @property
    def layout_sizes(self) -> str:
        """ "2*4", "2*2*4" or "2*2*4" (pp first): the sizes :attr:`layout_name` names, for messages."""
        sizes = (self.tp or 1, self.cp, self.dp or 1) if self.cp > 1 else (self.tp or 1, self.dp or 1)
        return "*".join(map(str, ((self.pp,) if self.pp > 1 else ()) + sizes))

    @property
    def pipeline_microbatches(self) -> int:
        """Pipeline micro-batches per micro-step: ``--microbatches``, else pp."""
        return self.microbatches or self.pp

    @property
    def row_multiple(self) -> int:
        """Rows are padded to a multiple of this (:attr:`ParallelDims.row_multiple`)."""
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


def merge(base: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """``base`` with ``overrides`` (only keys whose value is not None) applied."""
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


__all__ = [
    "AUX_LOSS_OVER",
    "DEVICES",
    "DTYPES",
    "EMBEDDED_PROFILE",
    "GENERAL_PROFILE",
    "GROUPS",
    "OBJECTIVES",
    "REPORTERS",
    "TrainConfig",
    "merge",
    "parse_profile_steps",
]
