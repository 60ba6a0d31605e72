"""Data for training: load and tokenize a dataset (text, chat, prompt/completion), plan global
batches, pad batches.

Names are imported on first use: the launching process checks a dataset (``hf_tp.data.datasets``)
without loading torch, which the collator and the batch plan need.
"""

from __future__ import annotations

from hf_tp.lazy import lazy_names

# public name -> module that defines it
_PUBLIC: dict[str, str | tuple[str, str]] = {
    "GlobalBatchOrder": "hf_tp.data.sampler",
    "PadToMultipleCollator": "hf_tp.data.collator",
    "load_text_dataset": "hf_tp.data.datasets",
    "tokenize_dataset": "hf_tp.data.tokenize",
    "detect_format": "hf_tp.data.formats",
    "DataFormat": "hf_tp.data.formats",
}


__getattr__ = lazy_names(__name__, _PUBLIC)

__all__ = sorted(_PUBLIC)
