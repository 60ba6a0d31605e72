"""The training loop, its config, launcher and metrics.

Only the config is imported eagerly: ``hf-tp export --help`` and friends must not load the
training stack (torch, transformers, datasets).
"""

from hf_tp.run.config import TrainConfig

__all__ = ["TrainConfig", "TrainResult", "train"]


def __getattr__(name: str):
    if name in ("TrainResult", "train"):
        from hf_tp.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'hf_tp.train' has no attribute {name!r}")
