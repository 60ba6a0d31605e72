"""Models that ship their own Python code (``auto_map`` in config.json): run only on request.

transformers imports a repository's ``configuration_*.py`` / ``modeling_*.py`` when called with
``trust_remote_code=True``, and when the argument is left out it asks on stdin (or fails where
there is no terminal, as in every rank). hf_tp decides once, here: a model transformers has itself
is always built from transformers' classes (the ones hf_tp's plans and parity tests cover), even
when its repository also ships code; a model that cannot load without its code is refused with one
line naming :data:`FLAG` unless the run opted in, and then its classes are registered with
transformers' Auto classes, so every later ``from_pretrained``/``from_config`` of this process
(the adapters' plan included) builds the same classes without asking again.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

FLAG = "--trust-remote-code"
MODEL_AUTO_CLASS = "AutoModelForCausalLM"


class RemoteCodeRefused(ValueError):
    """The model needs its own Python code and the run did not pass :data:`FLAG`."""


def needs_remote_code(exc: BaseException) -> bool:
    """Whether transformers refused to load something because it would have to run its code."""
    return "trust_remote_code" in str(exc)


def warn(source: str | Path) -> None:
    """One line on stderr naming the repo whose code is about to run."""
    print(
        f"hf-tp: warning: {FLAG}: running the Python code that {source} ships (its config.json's auto_map); "
        "it runs with your permissions: use this only for a repo you trust",
        file=sys.stderr,
        flush=True,
    )


def auto_config(
    source: str | Path, trust: bool, *, say: Callable[[str | Path], None] | None = warn, **kwargs: Any
) -> PretrainedConfig:
    """``AutoConfig.from_pretrained(source, **kwargs)`` without running code the model ships,
    unless ``trust`` and the model cannot load otherwise: then ``say`` names it, its code is
    loaded and its classes registered (:func:`register_classes`). Raises
    :class:`RemoteCodeRefused` when the code is needed and ``trust`` is off."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=False, **kwargs)
    except ValueError as exc:
        if not needs_remote_code(exc):
            raise
    if not trust:
        raise RemoteCodeRefused(
            f"{source} needs its own Python code to load (its config.json's auto_map names classes transformers "
            f"does not have); read that code, then pass {FLAG} to run it"
        )
    if say is not None:
        say(source)
    config = AutoConfig.from_pretrained(source, trust_remote_code=True, **kwargs)
    register_classes(config, source)
    return config


def register_classes(config: PretrainedConfig, source: str | Path) -> None:
    """Register ``config``'s class (by model_type) and its causal-LM class (``auto_map``) with
    transformers' Auto classes, as transformers does after a ``trust_remote_code=True`` build."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    try:
        AutoConfig.register(config.model_type, type(config), exist_ok=True)
    except ValueError:  # a model_type transformers has: its own class stays
        pass
    ref = (getattr(config, "auto_map", None) or {}).get(MODEL_AUTO_CLASS)
    if ref is None:
        return
    repo, _, ref = ref.rpartition("--")  # "owner/repo--modeling_x.Class": code kept in another repo
    model_class = get_class_from_dynamic_module(ref, repo or source)
    try:  # transformers gives remote causal LMs generate() the same way
        from transformers.models.auto.auto_factory import add_generation_mixin_to_remote_model

        model_class = add_generation_mixin_to_remote_model(model_class)
    except ImportError:
        pass
    AutoModelForCausalLM.register(type(config), model_class, exist_ok=True)


def copy_model_code(model: torch.nn.Module, folder: Path) -> None:
    """The source files of ``model``'s class when it is a model's own code (loaded with
    :data:`FLAG`), copied into ``folder`` beside its config.json: what an export of it needs."""
    hf = next((m for m in model.modules() if type(m).__module__.startswith("transformers_modules.")), None)
    if hf is None:
        return
    from transformers.dynamic_module_utils import get_relative_import_files

    source = Path(sys.modules[type(hf).__module__].__file__ or "")
    folder.mkdir(parents=True, exist_ok=True)
    for path in [source, *map(Path, get_relative_import_files(str(source)))]:
        shutil.copyfile(path, folder / path.name)
