"""What one estimate simulates: the model's config (``--model``: :func:`resolve_model_config`), the
layout and the step's shape (:class:`EstimateSpec`), checked once (:func:`validate`) with the layout
rules training and ``hf_tp.parallelize`` share, and what a multimodal wrapper's images add to it
(:func:`image_load`).

The model's config comes from a bundled short name, a local dir or config.json, or a Hub id, as
:class:`hf_tp.core.model_source.ModelSource` resolves it (the bundled configs make
``hf-tp estimate --model llama-3.1-8b`` work offline; listing them, :func:`bundled_models`, for
``--help``, reads json only). This module imports torch and transformers (through
``hf_tp.adapters``) only inside the functions that need them.

Images (``--images-per-row``) are counted from the config: the simulated step itself is text-only (a
wrapper's image path has data-dependent shapes, the placeholder positions and 3-D positions, that
fake tensors cannot run). What hf_tp does with an image batch (docs/multimodal.md): every tp rank
runs the vision tower and projector whole on its dp rank's images (the tower FSDP2-gathered over
dp), the merged image + text embeddings are whole on every tp rank from the merge to the language
model's entry, where sequence parallelism splits them again. So per rank, beyond the text step at
the same ``seq_len``:

- the projector's saved activations (it trains): its input (the tower's features) and the two
  activations of its MLP (linear, activation, linear: LLaVA's, Qwen's merger);
- the merged sequence: the embeddings with the image features scattered in (a copy, kept for
  backward), and under tp that copy and its gradient whole on the rank instead of a 1/tp shard;
- not in the peak: the frozen tower's working set (no grad: nothing kept for backward), over the
  micro-batch's images at once, per tower token its hidden states in and out, the attention's
  q/k/v and the MLP's intermediate (memory-efficient attention: no token x token scores). It is
  transient at the forward's start, when little else is live.

Checked once by hand against torch's ``MemTracker`` on a real CPU step of plain transformers (a LLaVA
of a 512-wide, 4-layer CLIP tower at 224 pixels and a 512-wide 2-layer Llama, 2 images in a 1024-token
row, fp32): the step's peak grew by 6.0 MiB with the images, 5.0 MiB counted here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_tp.compat import UnsupportedRelease, moe_estimate_refusal
from hf_tp.core.dims import (
    LAYOUT_DIMS,
    ParallelDims,
    check_cp_rows,
    check_layout,
    check_pipeline_dims,
    check_pipeline_rows,
    check_positive,
)
from hf_tp.core.model_source import ModelSource
from hf_tp.run.validate import check_mixed_precision, validate_model_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DTYPES = ("bf16", "fp32")
MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class EstimateSpec:
    """One training step's layout and shape, as ``hf-tp train`` would run it.

    ``batch_size`` is sequences per dp rank. ``ep`` > 1 (mixture-of-experts models) splits each MoE
    layer's experts over ep of the dp (x cp) ranks; ``cp`` > 1 splits each row's tokens over cp
    ranks; ``dp_replicate`` > 1 is HSDP (the state sharded over the dp / dp_replicate ranks of a
    replica). ``lora_r`` > 0 is a ``--lora-r`` run on ``lora_target_modules``. ``pp`` > 1 cuts the
    decoder layers into pipeline stages run by ``pp_schedule`` (``pp_virtual_stages`` stages per
    rank), a dp rank's ``batch_size`` rows split into ``microbatches`` (:mod:`hf_tp.estimate.layouts`).
    The field order is :func:`hf_tp.estimate.estimate`'s positional order.
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
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    microbatches: int = 1

    @property
    def dims(self) -> ParallelDims:
        """The layout of this step (:class:`hf_tp.core.dims.ParallelDims`)."""
        return ParallelDims.of(self)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.cp * self.dp

    def replace(self, **changes) -> EstimateSpec:
        """This spec with ``changes`` (another split, batch or activation checkpointing)."""
        return dataclasses.replace(self, **changes)


def validate(config: PretrainedConfig, spec: EstimateSpec) -> None:
    """One-line ``ValueError``s for sizes that cannot be trained, before anything is built. A
    quantized checkpoint's config is sized as its dequantized copy (what hf_tp trains)."""
    from hf_tp.adapters.quantized import full_precision
    from hf_tp.core.module_queries import num_experts  # torch: imported on use (see the module's docstring)

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
    check_pipeline_spec(config, spec)


def check_pipeline_spec(config: PretrainedConfig, spec: EstimateSpec) -> None:
    """The pipeline settings as ``hf-tp train --pp`` checks them (:func:`hf_tp.core.dims.check_pipeline_dims`,
    the rows split evenly into micro-batches); cp and ep inside the stages are checked as at pp 1
    (:func:`validate`: ep divides a stage's dp x cp, rows a multiple of 2 x cp x tp), the model's own
    cut (wrappers, a tied lm_head under a V-shaped schedule) where the stages are cut
    (:mod:`hf_tp.estimate.layouts`)."""
    layers = None
    if isinstance(spec.pp, int) and spec.pp > 1:
        from hf_tp.adapters import wrapper  # torch: imported on use

        layers = (wrapper.text_config_of(config) or config).num_hidden_layers
    check_pipeline_dims(spec.pp, spec.pp_schedule, spec.microbatches, spec.pp_virtual_stages, layers=layers)
    if spec.pp > 1:
        check_pipeline_rows(spec.batch_size, spec.microbatches, flags=False)


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


# The model's config (hf-tp estimate --model)


def resolve_model_config(model: str) -> tuple[PretrainedConfig, str]:
    """``(config, label)`` for ``--model``: a local dir or config.json, a bundled short name (or
    its Hub id, served offline from the bundle), else a Hub id
    (:meth:`hf_tp.core.model_source.ModelSource.for_shapes`)."""
    source = ModelSource.for_shapes(model)
    return source.config, source.name


# Image inputs (hf-tp estimate --images-per-row / --image-size)

BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class ImageLoad:
    """Images of one micro-batch on one rank and the memory they add (bytes)."""

    images_per_row: int
    image_size: int
    tower_tokens: int  # patches each image becomes in the vision tower
    merged_tokens: int  # placeholder tokens each image takes in the merged sequence
    tower_working_set: int  # the frozen tower's transient peak over the micro-batch's images (not in the peak)
    projector_saved: int  # the projector's activations kept for backward
    merged_sequence: int  # the merged embeddings' copy, and under tp its whole (and gradient) beyond a shard

    @property
    def peak_extra(self) -> int:
        return self.projector_saved + self.merged_sequence


def image_load(
    config: PretrainedConfig,
    images_per_row: int,
    image_size: int,
    seq_len: int,
    batch_size: int,
    tp: int,
    dtype: str,
    projector_trains: bool = True,
) -> ImageLoad:
    """What ``images_per_row`` images of ``image_size`` pixels a side add to a step of ``config``
    (``projector_trains`` False: a LoRA run, whose frozen projector keeps nothing for backward)."""
    vision, text = getattr(config, "vision_config", None), getattr(config, "text_config", None)
    if vision is None or text is None:
        raise ValueError(
            f"--images-per-row needs a multimodal checkpoint with a vision tower; {config.model_type} has none"
        )
    size = _image_size(vision, image_size)
    patch = _side(getattr(vision, "patch_size", 14))
    tower_tokens = (size // patch) ** 2
    merged = _merged_tokens(config, vision, tower_tokens)
    if images_per_row * merged > seq_len:
        raise ValueError(
            f"{images_per_row} images of {size}x{size} take {images_per_row * merged} tokens of the merged sequence, "
            f"more than --seq-len {seq_len}: fewer images, smaller ones or a longer --seq-len"
        )
    b, images = BYTES[dtype], batch_size * images_per_row
    width = _width(vision)
    inner = getattr(vision, "intermediate_size", 4 * width)
    working = images * tower_tokens * (5 * width + inner) * b  # in, out, q, k, v; the MLP's intermediate
    projector = images * (tower_tokens * width + 2 * merged * text.hidden_size) * b if projector_trains else 0
    whole = batch_size * seq_len * text.hidden_size * b
    merged_sequence = whole + 2 * (whole - whole // tp)  # the copy; under tp, it and its gradient whole
    return ImageLoad(images_per_row, size, tower_tokens, merged, working, projector, merged_sequence)


def _image_size(vision: PretrainedConfig, image_size: int) -> int:
    """The pixels of a side: a fixed-size tower's own (``image_size`` must match it), else ``image_size``."""
    fixed = getattr(vision, "image_size", None)
    if fixed is not None and not getattr(vision, "spatial_merge_size", None):  # a fixed-resolution ViT
        fixed = _side(fixed)
        if image_size and image_size != fixed:
            raise ValueError(
                f"this vision tower takes {fixed}x{fixed} images (its processor resizes to it): "
                f"--image-size {image_size} does not apply; leave it out"
            )
        return fixed
    if not image_size:
        raise ValueError("this vision tower takes images of any size: give --image-size (pixels of a side)")
    return image_size


def _merged_tokens(config: PretrainedConfig, vision: PretrainedConfig, tower_tokens: int) -> int:
    """Placeholder tokens per image: the wrapper's own count where its config holds one, else the
    tower's patches merged ``spatial_merge_size`` x ``spatial_merge_size`` (Qwen-VL, Pixtral), or one each."""
    for name in ("mm_tokens_per_image", "image_seq_length"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    merge = getattr(vision, "spatial_merge_size", None) or getattr(config, "spatial_merge_size", None) or 1
    return max(1, tower_tokens // merge**2)


def _width(vision: PretrainedConfig) -> int:
    for name in ("embed_dim", "hidden_size", "width"):  # Qwen2-VL: hidden_size is its merger's output
        if isinstance(getattr(vision, name, None), int):
            return getattr(vision, name)
    raise ValueError(f"cannot read the vision tower's width from {type(vision).__name__}")


def _side(value) -> int:
    return value[0] if isinstance(value, (list, tuple)) else int(value)
