"""What one estimate simulates, as one object: the layout and the step's shape (:class:`EstimateSpec`),
checked once (:func:`validate`) with the layout rules training and ``hf_tp.parallelize`` share."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from transformers import PretrainedConfig

from hf_tp.adapters.modules import num_experts
from hf_tp.adapters.quantized import full_precision
from hf_tp.compat import UnsupportedRelease, moe_estimate_refusal
from hf_tp.layout import LAYOUT_DIMS, check_cp_rows, check_layout, check_positive
from hf_tp.train.validate import check_mixed_precision, validate_model_config

DTYPES = ("bf16", "fp32")
MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class EstimateSpec:
    """One training step's layout and shape, as ``hf-tp train`` would run it.

    ``batch_size`` is sequences per dp rank. ``ep`` > 1 (mixture-of-experts models) splits each MoE
    layer's experts over ep of the dp (x cp) ranks; ``cp`` > 1 splits each row's tokens over cp
    ranks; ``dp_replicate`` > 1 is HSDP (the state sharded over the dp / dp_replicate ranks of a
    replica). ``lora_r`` > 0 is a ``--lora-r`` run on ``lora_target_modules``. The field order is
    :func:`hf_tp.estimate.estimate`'s positional order.
    """

    tp: int
    dp: int
    seq_len: int
    batch_size: int
    dtype: str = "bf16"
    activation_checkpointing: bool = False
    ep: int = 1
    lora_r: int = 0
    lora_target_modules: str = "all-linear"
    cp: int = 1
    dp_replicate: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp

    def replace(self, **changes) -> EstimateSpec:
        """This spec with ``changes`` (another split, batch or activation checkpointing)."""
        return dataclasses.replace(self, **changes)


def validate(config: PretrainedConfig, spec: EstimateSpec) -> None:
    """One-line ``ValueError``s for sizes that cannot be trained, before anything is built. A
    quantized checkpoint's config is sized as its dequantized copy (what hf_tp trains)."""
    config = full_precision(config)
    for name in (*LAYOUT_DIMS, "seq_len", "batch_size"):
        check_positive(name, getattr(spec, name))
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got dtype={spec.dtype!r}")
    validate_model_config(config, spec.tp, spec.seq_len, seq_len_name="seq_len", ep=spec.ep, ep_name="ep")
    check_mixed_precision(config, spec.dtype)
    check_layout(spec.tp, spec.dp, spec.cp, spec.ep, spec.dp_replicate)
    if num_experts(config) and (refusal := moe_estimate_refusal(spec.dtype)):
        raise UnsupportedRelease(refusal)
    check_cp_rows(spec.seq_len, spec.tp, spec.cp)


_UNITS = {
    "": GiB,
    "b": 1,
    **{f"{p}{s}": 2 ** (10 * i) for i, p in enumerate("kmgt", 1) for s in ("", "i", "ib")},
    **{f"{p}b": 10 ** (3 * i) for i, p in enumerate("kmgt", 1)},
}


def parse_memory(text: str) -> int:
    """Bytes in ``"80GiB"``, ``"141GB"`` (decimal), ``"80G"``/``"80Gi"`` (binary) or ``"80"`` (GiB)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--gpu-memory '{text}' is not a memory size; write it like 80GiB, 141GB or 80")
    return int(float(match.group(1)) * _UNITS[unit])
