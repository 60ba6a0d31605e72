"""Checks of a run's inputs that can fail before any process or process group exists.

The launcher runs them once in the parent process so that a typo costs a second, not a
4-process start-up; each rank runs the model checks again, identically, before any collective.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hf_tp.core.dims import check_pipeline_layers
from hf_tp.data.columns import STANDARD as STANDARD_COLUMNS
from hf_tp.run.config import TrainConfig
from hf_tp.run.fits import check_batch_fits, check_step_memory
from hf_tp.run.run_dir import check_output_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# torch, transformers and the adapters are imported where they are needed, so that the checks of
# the inputs alone (numbers, paths, the dataset's first row) answer before they are loaded.


def load_model_config(model: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of ``hf-tp train``'s ``--model`` (:meth:`hf_tp.core.model_source.ModelSource.for_training`:
    one-line errors for a missing model, an unreachable Hub, code it ships without ``trust_remote_code``)."""
    from hf_tp.core.model_source import ModelSource

    return ModelSource.for_training(model, trust_remote_code).config


def validate_model_config(
    config: PretrainedConfig,
    tp: int,
    seq_len: int,
    seq_len_name: str = "--seq-len",
    ep: int = 1,
    ep_name: str = "--ep",
) -> None:
    """tp (and ep) against the architecture, the sequence length against the model's positions
    (for ``hf-tp train`` and ``hf-tp estimate``; ``seq_len_name``/``ep_name`` are how the caller
    names them)."""
    from hf_tp.adapters import get_adapter
    from hf_tp.core.module_queries import num_experts

    adapter = get_adapter(config)
    adapter.validate(config, tp)
    config = adapter.layers_config(config)  # a multimodal wrapper's sizes are its language model's
    if ep > 1:
        experts = num_experts(config)
        given = f"{ep_name} {ep}" if ep_name.startswith("-") else f"{ep_name}={ep}"  # a flag or an argument
        if not adapter.moe or experts is None:
            raise ValueError(
                f"{given} needs a mixture-of-experts model; this {config.model_type} model has no experts "
                f"(leave {ep_name} at 1)"
            )
        if experts % ep:
            raise ValueError(f"{ep_name} must divide the number of experts ({experts}) of this model, got {given}")
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise ValueError(
            f"{seq_len_name} {seq_len} is over this model's max_position_embeddings ({max_pos}); "
            f"use {seq_len_name} {max_pos} or less"
        )


def check_mixed_precision(config: PretrainedConfig, dtype: str) -> None:
    """A family whose own code breaks under bf16 mixed precision (fp32 buffers beside bf16
    compute) is refused before launch (``hf-tp train``, ``hf-tp estimate``), naming the fix."""
    from hf_tp.adapters.support import MIXED_PRECISION_REFUSED

    mt = (getattr(config, "text_config", None) or config).model_type
    if dtype == "bf16" and mt in MIXED_PRECISION_REFUSED:
        raise ValueError(
            f"bf16 mixed precision cannot train this {mt} model: {MIXED_PRECISION_REFUSED[mt]}; train it in fp32 (--dtype fp32)"
        )


def check_dataset_source(source: str) -> None:
    """A path-looking dataset that does not exist is an error now; Hub ids are checked on load."""
    looks_local = source.startswith((".", "/", "~")) or Path(source).suffix in {
        ".txt",
        ".json",
        ".jsonl",
        ".parquet",
        ".csv",
    }
    if looks_local and not Path(source).expanduser().exists():
        raise ValueError(f"dataset not found: no file or directory at '{source}'")


def device_type(cfg: TrainConfig) -> str:
    """ "cuda" or "cpu": where this run's ranks compute (the embedded default resolves to CPU)."""
    import torch

    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is visible")
    return "cuda"


def check_devices(cfg: TrainConfig, device_type: str) -> None:
    if device_type != "cuda":
        return
    import torch

    per_node = cfg.world_size // cfg.nnodes
    have = torch.cuda.device_count()
    if per_node > have:
        raise ValueError(
            f"{cfg.layout_name} = {cfg.layout_sizes} = {cfg.world_size} processes need {per_node} GPUs per node, "
            f"but {have} are visible; lower --tp/--dp or use --device cpu"
        )


def prelaunch_checks(cfg: TrainConfig) -> str:
    """Everything that can be checked from the parent process, cheapest first (paths, the
    dataset's first row, then the device and the model, which need torch and transformers);
    returns the device type."""
    cfg.validate()
    check_dataset_source(cfg.dataset)
    check_output_dir(Path(cfg.output_dir), cfg)
    check_packages(cfg)
    from hf_tp.core.model_files import check_model_source  # file names and headers: no torch, no tensors

    check_model_source(cfg.model)
    from hf_tp.data.datasets import check_text_dataset  # datasets (pyarrow, pandas), not torch

    columns = dict(text_column=cfg.text_column, messages_column=cfg.messages_column, config_name=cfg.dataset_config)
    columns.update(every_row=not cfg.streaming, skip_bad_rows=cfg.skip_bad_rows)  # each local row, before launch
    columns.update(renames=cfg.column_renames)
    first_rows = {cfg.dataset: check_text_dataset(cfg.dataset, split=cfg.split, **columns)}
    if cfg.eval_dataset:
        check_dataset_source(cfg.eval_dataset)
        first_rows[cfg.eval_dataset] = check_text_dataset(cfg.eval_dataset, split=cfg.eval_dataset_split, **columns)
    from hf_tp.data.formats.preference import check_objective_data  # (imports torch)

    for source, first in first_rows.items():  # the data's kind before its size: pairs for dpo, ...
        check_objective_data(cfg.objective, first[0] if first is not None else None, source)
    check_batch_fits(cfg)
    kind = device_type(cfg)
    check_devices(cfg, kind)
    model_config = load_model_config(cfg.model, cfg.trust_remote_code)
    validate_model_config(model_config, cfg.tp, cfg.seq_len, ep=cfg.ep)
    from hf_tp.adapters import get_adapter  # a wrapper's language model holds the layers

    check_pipeline_layers(cfg, get_adapter(model_config).layers_config(model_config).num_hidden_layers)
    if Path(cfg.model).expanduser().is_dir():  # every weight in the files, in its shape (headers only)
        from hf_tp.checkpoint.file_check import check_weights_match

        check_weights_match(cfg.model, model_config)
    if warning := check_step_memory(cfg, model_config, kind):  # refused when far beyond
        print(f"hf-tp train: warning: {warning}", file=sys.stderr, flush=True)
    check_mixed_precision(model_config, cfg.compute_dtype_name(kind))
    if cfg.train_vision_tower and getattr(model_config, "text_config", None) is None:
        raise ValueError(
            f"--train-vision-tower needs a multimodal checkpoint; this {model_config.model_type} model has no "
            "vision tower (leave the flag out)"
        )
    if cfg.train_vision_tower and cfg.lora_r:
        raise ValueError("--train-vision-tower trains the tower's own weights, which --lora-r freezes: drop one")
    if cfg.resume:
        check_resume_before_launch(cfg, model_config)
    from hf_tp.run.first_rows import check_first_rows, check_image_data  # transformers' tokenizer, processor

    check_image_data(cfg, first_rows, model_config)
    check_first_rows(cfg, first_rows)
    return kind


def check_packages(cfg: TrainConfig) -> None:
    """The optional packages the flags name are installed: peft for ``--lora-r``, wandb for
    ``--report-to wandb``."""
    import importlib.util

    if "wandb" in cfg.reporters and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            "--report-to wandb needs the wandb package: pip install wandb (or use --report-to tensorboard)"
        )
    if cfg.lora_r and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora-r needs the peft package: pip install 'hf_tp[lora]' (or pip install peft)")


def check_resume_before_launch(cfg: TrainConfig, model_config: PretrainedConfig) -> None:
    """``--resume``: the newest whole checkpoint fits this run's settings (the ranks check again
    after loading); refused here, the run's directory is left exactly as it was."""
    from hf_tp.checkpoint.checkpoint_dirs import load_trainer_state
    from hf_tp.checkpoint.integrity import newest_good_checkpoint

    ckpt = newest_good_checkpoint(Path(cfg.output_dir), lambda line: None)  # the ranks name damaged ones
    if ckpt is None:
        return
    saved = dict(load_trainer_state(ckpt).get("fingerprint") or {})
    # The ranks may turn document masking off for a model whose mask cannot take it (and say so).
    saved.pop("document_masking", None)
    check_resume_compatible(saved, run_fingerprint(cfg, model_config), ckpt)


FINGERPRINT_MODEL_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def run_fingerprint(cfg: TrainConfig, config: PretrainedConfig) -> dict:
    """What a resumed run must share with the saved one for the data stream and weights to line up."""
    fp = {k: getattr(config, k, None) for k in FINGERPRINT_MODEL_FIELDS}
    fp.update(
        dataset=cfg.dataset,
        dataset_config=cfg.dataset_config,
        split=cfg.split,
        text_column=cfg.text_column,
        messages_column=cfg.messages_column,
        **{f"{name}_column": getattr(cfg, f"{name}_column") for name in STANDARD_COLUMNS},
        assistant_only_loss=cfg.assistant_only_loss,
        eval_split=cfg.eval_split,
        pack=cfg.pack is not False,  # (unset counts as True, as runs recorded it before pack could be unset)
        document_masking=cfg.document_masking,
        streaming=cfg.streaming,
        seq_len=cfg.seq_len,
        global_batch=cfg.global_batch,
        seed=cfg.seed,
        objective=cfg.objective,
    )
    return fp


def check_resume_compatible(saved: dict, current: dict, where: Path) -> None:
    # A key the saved run did not record (a setting added since) is not compared.
    for key in sorted(set(saved)):
        if saved.get(key) != current.get(key):
            raise ValueError(
                f"cannot resume from {where}: it was saved with {key}={saved.get(key)!r} but this run has "
                f"{key}={current.get(key)!r}; use the same setting or a new --output-dir"
            )
