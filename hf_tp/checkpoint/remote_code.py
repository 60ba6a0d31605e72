"""What a checkpoint of a model that ships its own Python code (``auto_map`` in config.json)
carries: that code, beside its config.json, so an export of it loads.

Whether such code runs at all is decided in :mod:`hf_tp.core.model_source` (only with
``--trust-remote-code``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def copy_model_code(model: torch.nn.Module, folder: Path) -> None:
    """The source files of ``model``'s class when it is a model's own code (loaded with
    ``--trust-remote-code``), copied into ``folder`` beside its config.json: what an export of it needs."""
    hf = next((m for m in model.modules() if type(m).__module__.startswith("transformers_modules.")), None)
    if hf is None:
        return
    from transformers.dynamic_module_utils import get_relative_import_files

    source = Path(sys.modules[type(hf).__module__].__file__ or "")
    folder.mkdir(parents=True, exist_ok=True)
    for path in [source, *map(Path, get_relative_import_files(str(source)))]:
        shutil.copyfile(path, folder / path.name)
