"""Where a model comes from: :class:`ModelSource`, decided once for train, plan, estimate, verify
and export.

What a user names (a local model folder or ``config.json``, a Hub id, a bundled short name, a
config object or a model) becomes the model's config, the class that holds it whole (a causal LM,
or a multimodal wrapper's own class), the weights ``from_pretrained`` reads (a folder or Hub id;
none for a bundled name or a config) and whether the model runs Python code it ships.

Only :func:`auto_config` reads a config with ``AutoConfig.from_pretrained`` (a unit test fails
on a call anywhere else in ``hf_tp``), so the remote-code decision is made in one place:
transformers imports a repository's ``configuration_*.py`` / ``modeling_*.py`` when called with
``trust_remote_code=True``, and when the argument is left out it asks on stdin (or fails where
there is no terminal, as in every rank). A model transformers has itself is always built from
transformers' classes (the ones hf_tp's plans and parity tests cover), even when its repository
also ships code; a model that cannot load without its code is refused with one line naming
:data:`FLAG` unless the run opted in, and then its classes are registered with transformers'
Auto classes, so every later ``from_pretrained``/``from_config`` of this process (the adapters'
plan included) builds the same classes without asking again.

The bundled configs (``hf_tp/core/models/*.json``) hold the published shapes of a few common
models, so ``hf-tp estimate --model llama-3.1-8b`` and ``hf-tp plan`` work offline. Listing them
(:func:`bundled_models`, for ``--help``) reads json only: this module imports torch and
transformers only inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_tp.core.model_files import looks_local

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

FLAG = "--trust-remote-code"
MODEL_AUTO_CLASS = "AutoModelForCausalLM"
_OWNERLESS_FIX = "pass a model folder's path, or a Hub id (most are owner/name, e.g. Qwen/Qwen2-0.5B)"


class RemoteCodeRefused(ValueError):
    """The model needs its own Python code and the run did not pass :data:`FLAG`."""


# Reading a config: the one call of AutoConfig.from_pretrained, and the remote-code decision


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


# The Hub, the files, the bundled configs


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """None if the Hub answers (any HTTP status) within ``timeout`` seconds, else why not.

    One request, no retries: ``from_pretrained`` retries a refused connection 5 times with backoff
    (about 25 s per file) before it says the Hub cannot be reached. ``HF_HUB_OFFLINE`` counts as
    unreachable (its files then come from the cache only)."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - DNS, refused, timeout, proxy: all "unreachable"
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
    return None


def local_model_dir(model: str) -> Path:
    """A local folder holding the model's files (downloading config + safetensors from the Hub if needed)."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    # *.py: the code of a model that ships its own (run only with --trust-remote-code)
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.py"]
    return Path(snapshot_download(model, allow_patterns=patterns))


def bundled_models() -> dict[str, str]:
    """Short name -> Hub id of every bundled config, sorted by short name."""
    out = {}
    for entry in sorted(resources.files("hf_tp.core").joinpath("models").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            out[entry.name[: -len(".json")]] = json.loads(entry.read_text()).get("_name_or_path", "")
    return out


def config_from_dict(data: dict) -> PretrainedConfig:
    """A transformers config object from the contents of a ``config.json`` (no code runs)."""
    from transformers import CONFIG_MAPPING

    model_type = data.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"config.json has model_type {model_type!r}, which transformers does not know")
    return CONFIG_MAPPING[model_type].from_dict(dict(data))


def bundled_config(short_name: str) -> PretrainedConfig:
    """The bundled config of ``short_name`` (case-insensitive); a ``ValueError`` naming them if unknown."""
    name = short_name.lower()
    models = bundled_models()
    if name not in models:
        raise ValueError(f"unknown model short name '{short_name}'; bundled ones are: {', '.join(models)}")
    entry = resources.files("hf_tp.core").joinpath("models", f"{name}.json")
    return config_from_dict(json.loads(entry.read_text()))


# What a user names, resolved


@dataclass(frozen=True)
class ModelSource:
    """A model as hf_tp resolved it: ``config``, ``name`` (what reports call it: the folder,
    config.json, Hub id or bundled model's Hub id; "" for an object), ``weights`` (the folder or
    Hub id ``from_pretrained`` reads; None: shapes only) and ``module`` (the model, when one was
    given). Build one with :meth:`for_training`, :meth:`for_shapes` or :meth:`at`."""

    config: PretrainedConfig
    name: str = ""
    weights: str | None = None
    module: nn.Module | None = None

    @property
    def model_class(self) -> type[nn.Module]:
        """The class that holds the model whole: a multimodal wrapper's own, else ``AutoModelForCausalLM``."""
        from transformers import AutoModelForCausalLM

        return wrapper_class(self.config) or AutoModelForCausalLM

    @property
    def runs_own_code(self) -> bool:
        """Whether the model is built from Python code it ships (loaded with :data:`FLAG`)."""
        return type(self.config).__module__.startswith("transformers_modules.")

    @classmethod
    def for_training(cls, model: str, trust_remote_code: bool = False) -> ModelSource:
        """``--model`` of ``hf-tp train``: a local folder or a Hub id whose config loads, with a
        one-line error for a missing model and for one that needs its own code without
        ``trust_remote_code``. For a Hub id one quick request first asks whether the Hub answers
        at all; if it does not, the config comes from the Hub cache or the error says so at once
        (``from_pretrained`` alone spends about 25 s in retries first). ``HF_HUB_OFFLINE=1`` uses
        the cache only."""
        if Path(model).expanduser().exists():
            return cls(_config_or_not_found(model, "local directory", trust_remote_code), model, model)
        if looks_local(model):  # absolute, ./ or ~, or no Hub id's form: a path that is not there
            raise ValueError(f"model not found: no file or directory at '{model}'")
        unreachable = hub_unreachable()
        if unreachable is None:
            return cls(_config_or_not_found(model, "Hub id or local directory", trust_remote_code), model, model)
        return cls(_cached_config(model, trust_remote_code, unreachable), model, model)

    @classmethod
    def for_shapes(cls, given: str | os.PathLike | PretrainedConfig | nn.Module) -> ModelSource:
        """What ``hf-tp plan``, ``estimate`` and ``verify`` (and :func:`hf_tp.plan_for`) take: a
        model or config object as it is, a local folder or config.json (read as JSON: no code
        runs), a bundled short name or its Hub id (offline), else a Hub id: from the Hub cache
        first (no request at all when it is there), then the Hub."""
        from transformers import PretrainedConfig

        if isinstance(given, PretrainedConfig):
            return cls(given)
        if not isinstance(given, str | os.PathLike):
            return cls(given.config, module=given)
        model = os.fspath(given)
        path = Path(model).expanduser()
        if path.is_file():
            return cls(config_from_dict(json.loads(path.read_text())), str(path))
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(
                    f"local directory '{model}' has no config.json; pass a model dir or a config.json file"
                )
            return cls(config_from_dict(json.loads((path / "config.json").read_text())), str(path), str(path))
        if model.startswith((".", "/", "~")) or model.endswith(".json"):
            raise ValueError(f"model not found: no file or directory at '{model}'")
        return cls._named(model)

    @classmethod
    def _named(cls, model: str) -> ModelSource:
        """:meth:`for_shapes` of a name that is not a path: bundled, cached, or on the Hub."""
        models = bundled_models()
        by_hub_id = {hub_id.lower(): short for short, hub_id in models.items() if hub_id}
        short = model.lower() if model.lower() in models else by_hub_id.get(model.lower())
        if short is not None:
            return cls(bundled_config(short), models[short] or short)
        if "/" not in model:
            raise ValueError(
                f"unknown model '{model}': not a bundled short name ({', '.join(models)}), a local path, or a Hub id"
            )
        try:
            return cls(auto_config(model, False, say=None, local_files_only=True), model, model)
        except RemoteCodeRefused:
            raise
        except (OSError, ValueError):
            pass  # not in the cache: ask the Hub, or say why not
        try:
            return cls.for_training(model)  # one quick request when the Hub is unreachable
        except ValueError as exc:
            raise ValueError(
                f"cannot load a config for '{model}' ({exc}); offline, use a local dir/config.json or a bundled "
                f"short name: {', '.join(models)}"
            ) from None

    @classmethod
    def at(
        cls, files: str | Path, trust_remote_code: bool = False, *, say: Callable[[str | Path], None] | None = warn
    ) -> ModelSource:
        """The model whose files are at ``files`` (a folder or Hub id) read as they are: the ranks'
        load after the launcher's checks, a checkpoint's ``model_files``, an exported folder.
        ``say`` names code about to run (None: said already, as the launcher does for the ranks)."""
        return cls(auto_config(files, trust_remote_code, say=say), str(files), str(files))

    def build(self, **kwargs: Any) -> nn.Module:
        """The model of :attr:`config` (``from_config``, its :attr:`model_class`; no weights read)."""
        return model_from_config(self.config, **kwargs)

    def load(self, **kwargs: Any) -> nn.Module:
        """The model with its weights: :attr:`model_class`'s ``from_pretrained`` of :attr:`weights`."""
        if self.weights is None:
            raise ValueError(
                f"{self.name or self.config.model_type} is a config only, with no weights to load; "
                "name a model folder or a Hub id"
            )
        return self.model_class.from_pretrained(self.weights, **kwargs)

    def local_dir(self) -> Path:
        """A local folder holding :attr:`weights`' files (downloaded from the Hub if needed)."""
        if self.weights is None:
            raise ValueError(f"{self.name or self.config.model_type} is a config only, with no files to download")
        return local_model_dir(self.weights)


def _config_or_not_found(model: str, where: str, trust_remote_code: bool) -> PretrainedConfig:
    """:func:`auto_config` of ``model`` (the Hub reachable), its failures as "model not found"."""
    try:
        return auto_config(model, trust_remote_code)
    except RemoteCodeRefused:
        raise
    except (OSError, ValueError) as exc:
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        cause = exc.__cause__  # transformers re-raises huggingface_hub's error as an OSError
        not_on_hub = isinstance(cause, RepositoryNotFoundError) and not isinstance(cause, GatedRepoError)
        if not_on_hub and where != "local directory":
            raise _not_found(
                model,
                f"no model '{model}' on the Hub",
                f"no model '{model}' on the Hub and no local directory of that name; check the id, or log in "
                "(hf auth login) if it is a private model",
            ) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"model not found: cannot load a config from {where} '{model}' ({first})") from None


def _not_found(model: str, ownerless: str, owned: str) -> ValueError:
    """ "model not found": for a name without an owner (a folder name mistyped, or a Hub id such as
    gpt2) both readings and the fix (``ownerless``: the Hub's side), else ``owned``."""
    if "/" not in model:
        return ValueError(
            f"model not found: there is no directory '{model}' in {Path.cwd()}, and {ownerless}; {_OWNERLESS_FIX}"
        )
    return ValueError(f"model not found: {owned}")


def _cached_config(model: str, trust_remote_code: bool, unreachable: str) -> PretrainedConfig:
    """The Hub cache's config of Hub id ``model`` when the Hub cannot be reached (``unreachable``
    says why), or a one-line error: not cached, or cached but HF_HUB_OFFLINE unset."""
    from huggingface_hub import constants

    try:
        config = auto_config(model, trust_remote_code, local_files_only=True)
    except RemoteCodeRefused:
        raise
    except (OSError, ValueError):
        raise _not_found(
            model,
            f"no Hub model '{model}' in the Hub cache (the Hub cannot be reached: {unreachable})",
            f"'{model}' is not a local directory and not in the Hub cache, and the Hub cannot be reached ({unreachable})",
        ) from None
    if not constants.HF_HUB_OFFLINE:  # the ranks would retry every file for minutes before using the cache
        raise ValueError(
            f"the Hub cannot be reached ({unreachable}); '{model}' is in the Hub cache: set HF_HUB_OFFLINE=1 "
            "to train from the cache"
        )
    return config


def text_config_of(config: PretrainedConfig) -> PretrainedConfig | None:
    """A multimodal wrapper's text config (its language model's), else None."""
    from transformers import PretrainedConfig

    text = getattr(config, "text_config", None)
    return text if isinstance(text, PretrainedConfig) and text is not config else None


def wrapper_class(config: PretrainedConfig) -> type[nn.Module] | None:
    """The class that holds a wrapper checkpoint whole: the one ``config.architectures`` names when
    transformers has it for this config class, else the image-text-to-text (or multimodal, or
    causal-LM) auto mapping's; None for a plain causal-LM config (``AutoModelForCausalLM``)."""
    if text_config_of(config) is None:
        return None
    import transformers
    from transformers.models.auto import modeling_auto as auto

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and cls.config_class is not None and isinstance(config, cls.config_class):
            return cls
    for mapping in (
        auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        auto.MODEL_FOR_MULTIMODAL_LM_MAPPING,
        auto.MODEL_FOR_CAUSAL_LM_MAPPING,
    ):
        if type(config) in mapping:
            return mapping[type(config)]
    raise ValueError(
        f"transformers has no model class for this {config.model_type} checkpoint (its config names "
        f"{getattr(config, 'architectures', None)}); hf_tp trains causal LMs and multimodal wrappers with a text_config"
    )


def model_from_config(config: PretrainedConfig, **kwargs) -> nn.Module:
    """The whole model of ``config``: its wrapper class for a multimodal wrapper, else its causal LM."""
    from transformers import AutoModelForCausalLM

    from hf_tp.compat.transformers_private import model_of_class

    cls = wrapper_class(config)
    return AutoModelForCausalLM.from_config(config, **kwargs) if cls is None else model_of_class(cls, config, **kwargs)
