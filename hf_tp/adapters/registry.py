"""The adapter registry: how hf_tp finds the TP+SP plan of a model family.

The top of the adapters package: a registered (hand-written) adapter for the config's
``model_type`` wins; a family hf_tp refuses gets its reason; a multimodal wrapper (a config with a
``text_config``) gets its language model's adapter re-rooted in it (:mod:`hf_tp.adapters.wrapper`);
anything else gets the plan derived from its model (:mod:`hf_tp.adapters.generic`). The registry
starts with the hand-written entries of the family table (:mod:`hf_tp.adapters.families`); an
architecture is added there, or from outside with :func:`register_adapter`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from transformers import PretrainedConfig

from hf_tp.adapters.adapter import Adapter
from hf_tp.adapters.families import HAND_WRITTEN
from hf_tp.adapters.generic import generic_adapter
from hf_tp.adapters.support import GENERIC, MOE, REFUSED, WRAPPER_REFUSED
from hf_tp.adapters.text_tower import is_text_tower
from hf_tp.adapters.wrapper import refuse, wrapper_adapter
from hf_tp.compat import UnsupportedRelease, family_refusal
from hf_tp.core.model_source import text_config_of

_REGISTRY: dict[str, Adapter] = dict(HAND_WRITTEN)  # the family table's hand-written plans
_CHANGE: contextvars.ContextVar[Callable[[Adapter], Adapter] | None] = contextvars.ContextVar("change", default=None)
HOW_TO_REGISTER = (
    "hf_tp.register_adapter(Adapter(model_type='{mt}', layer_plan=..., top_plan=...)) (see hf_tp/adapters/families.py)"
)


def register_adapter(adapter: Adapter, *, overwrite: bool = False) -> Adapter:
    """Register ``adapter`` for its ``model_type``; registering a type twice is an error."""
    if adapter.model_type in _REGISTRY and not overwrite:
        raise ValueError(
            f"an adapter for model_type '{adapter.model_type}' is already registered; pass overwrite=True to replace it"
        )
    _REGISTRY[adapter.model_type] = adapter
    return adapter


def unregister_adapter(model_type: str) -> None:
    """Remove the adapter of ``model_type`` (mainly for tests and notebooks)."""
    _REGISTRY.pop(model_type, None)


def registered_model_types() -> list[str]:
    """The ``model_type`` values with a hand-written (registered) adapter, sorted."""
    return sorted(_REGISTRY)


def supported_model_types() -> list[str]:
    """Every ``model_type`` hf_tp trains: the registered adapters and the families whose generic
    plan holds parity in the test grid (``hf_tp/adapters/support.py``), sorted."""
    return sorted(set(_REGISTRY) | set(GENERIC) | set(MOE))


def get_adapter(config_or_type: PretrainedConfig | str) -> Adapter:
    """The adapter for a config: the registered one for its ``model_type``, else the generic plan
    derived from its model (:mod:`hf_tp.adapters.generic`), else a ``ValueError`` saying why.
    A bare ``model_type`` string finds registered adapters only (deriving needs the config)."""
    adapter = _adapter(config_or_type, in_wrapper=False)
    change = _CHANGE.get()
    return adapter if change is None else change(adapter)


@contextlib.contextmanager
def changed_adapters(change: Callable[[Adapter], Adapter]) -> Iterator[None]:
    """Inside the block, :func:`get_adapter` returns ``change(adapter)``, in this thread (a context
    variable: the rank threads of one process each see their own). ``hf-tp verify``'s injected
    faults use it to build a layout with a wrong plan (:mod:`hf_tp.verify.injected_faults`)."""
    token = _CHANGE.set(change)
    try:
        yield
    finally:
        _CHANGE.reset(token)


def _adapter(config_or_type: PretrainedConfig | str, *, in_wrapper: bool) -> Adapter:
    """:func:`get_adapter`; ``in_wrapper``: a wrapper's text tower, which may have no causal LM of its own."""
    model_type = config_or_type if isinstance(config_or_type, str) else config_or_type.model_type
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    if refusal := family_refusal(model_type):  # the installed transformers is older than the family needs
        raise UnsupportedRelease(refusal)
    how = HOW_TO_REGISTER.format(mt=model_type)
    if model_type in REFUSED:
        raise ValueError(
            f"hf_tp does not support model_type '{model_type}': {REFUSED[model_type]}. Add an adapter with {how}"
        )
    if model_type in WRAPPER_REFUSED:
        raise refuse(model_type, WRAPPER_REFUSED[model_type])
    if not isinstance(config_or_type, str) and (text := text_config_of(config_or_type)) is not None:
        return wrapper_adapter(config_or_type, _text_adapter(model_type, text))
    if not in_wrapper and not isinstance(config_or_type, str) and is_text_tower(config_or_type):
        raise ValueError(
            f"model_type '{model_type}' is the language model of a multimodal wrapper, which transformers builds "
            "only inside that wrapper (it has no causal-LM class of its own): train the wrapper's checkpoint "
            "(its config holds this one as text_config)"
        )
    if isinstance(config_or_type, str):
        raise ValueError(
            f"no registered hf_tp adapter for model_type '{model_type}' (a generic plan is derived from a config: "
            f"pass the model's config); supported: {', '.join(supported_model_types())}"
        )
    return generic_adapter(config_or_type)


def _text_adapter(model_type: str, text: PretrainedConfig) -> Adapter:
    """A multimodal wrapper's language-model adapter, or its refusal naming the wrapper."""
    try:
        return _adapter(text, in_wrapper=True)
    except ValueError as exc:
        raise type(exc)(
            f"hf_tp cannot train this {model_type} checkpoint: it is a multimodal wrapper whose language model "
            f"({text.model_type}) is not supported: {exc}"
        ) from None
