"""A run with the embedded default filled in: ``hf-tp train`` with no ``--model`` or ``--dataset``
trains the tiny Llama on the generated corpus (:mod:`hf_tp.demo`), offline."""

from __future__ import annotations

import dataclasses

from hf_tp.run.config import TrainConfig


def with_embedded_default(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with unset settings resolved and the embedded model/corpus filled in where
    ``model``/``dataset`` is None (built once, then cached; see :mod:`hf_tp.demo.assets`). The
    embedded default itself (neither given) saves a final checkpoint unless checkpoints or an
    export were asked for, so that ``hf-tp export outputs/run exported/`` (README's next command)
    has one to read."""
    cfg = cfg.resolve()
    if cfg.model is not None and cfg.dataset is not None:
        return cfg
    from hf_tp.demo.assets import ensure_default_assets  # tokenizers + transformers: only when needed

    assets = ensure_default_assets()
    final = cfg.max_steps if cfg.model is None and cfg.dataset is None and not cfg.save_every else cfg.save_every
    return dataclasses.replace(
        cfg,
        model=cfg.model or str(assets.model_dir),
        dataset=cfg.dataset or str(assets.data_file),
        save_every=cfg.save_every if cfg.export_on_finish else final,
    )
