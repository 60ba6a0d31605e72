"""Data for training: load and tokenize a text dataset, plan global batches, pad batches."""

from hf_tp.data.collator import PadToMultipleCollator
from hf_tp.data.datasets import load_text_dataset, tokenize_dataset
from hf_tp.data.sampler import GlobalBatchOrder

__all__ = ["GlobalBatchOrder", "PadToMultipleCollator", "load_text_dataset", "tokenize_dataset"]
