"""The training loop, its config, launcher and metrics."""

from hf_tp.train.config import TrainConfig
from hf_tp.train.loop import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]
