"""``hf-tp train --pp``: the settings a pipeline run takes, checked on every rank before launch."""

from __future__ import annotations

from typing import Any

from hf_tp.pipeline_checks import check_pipeline


def check_pipeline_settings(cfg: Any) -> None:
    """One line for a pipeline setting that cannot run, or a combination not exact with pipeline
    stages yet (each naming the fix). ``cfg``: a :class:`hf_tp.train.config.TrainConfig`."""
    if cfg.microbatches is not None and (isinstance(cfg.microbatches, bool) or cfg.microbatches < 1):
        raise ValueError(f"--microbatches must be a positive integer, got {cfg.microbatches!r}")
    if cfg.pp == 1:
        if cfg.microbatches not in (None, 1) or cfg.pp_virtual_stages != 1 or cfg.pp_schedule != "1f1b":
            raise ValueError(
                "--microbatches, --pp-schedule and --pp-virtual-stages are pipeline settings: add --pp N (N > 1)"
            )
        return
    check_pipeline(cfg.pp, cfg.pp_schedule, cfg.pipeline_microbatches, cfg.pp_virtual_stages)
    rows = cfg.batch_size
    if rows is not None and rows % cfg.pipeline_microbatches:
        raise ValueError(
            f"--batch-size ({rows}) must be a multiple of --microbatches ({cfg.pipeline_microbatches}): "
            "each pipeline micro-batch takes an equal share of a dp rank's rows"
        )
    refused = {
        "--compile": cfg.compile,
        "--train-vision-tower": cfg.train_vision_tower,
    }
    for flag, on in refused.items():
        if on:
            raise ValueError(f"--pp does not combine with {flag} yet: drop one (or train with --pp 1)")
    if cfg.objective != "sft" and (cfg.eval_split or cfg.eval_dataset):
        raise ValueError(
            f"--pp with --objective {cfg.objective} does not evaluate held-out pairs yet: "
            "drop --eval-split / --eval-dataset (or train with --pp 1)"
        )


def check_pipeline_layers(cfg: Any, model_config: Any) -> None:
    """Before launch, once the model's config is read: no more pipeline stages (``--pp`` x
    virtual stages) than the model has decoder layers (the ranks check again where they cut)."""
    if cfg.pp == 1:
        return
    from hf_tp.adapters import get_adapter

    config = get_adapter(model_config).layers_config(model_config)  # a wrapper's language model
    check_pipeline(cfg.pp, cfg.pp_schedule, cfg.pipeline_microbatches, cfg.pp_virtual_stages, config.num_hidden_layers)
