"""Multimodal wrappers: a language model plus passengers.

A checkpoint whose config carries a ``text_config`` (Gemma 3, Mistral 3, Qwen3.5, LLaVA, ...) is
built as its ``*ForConditionalGeneration`` class: a vision (or audio) tower, a projector, the
language model and an ``lm_head``. hf_tp places it through its language model: the text tower's
own adapter (found by ``text_config.model_type``), with every plan path re-rooted where this
wrapper keeps the language model and its lm_head, both found from the model (built on the meta
device) rather than from a table. Everything else is a *passenger*: not tensor-parallelized
(replicated over tp), sharded over dp by FSDP2 as units of its own, and frozen, since text data
never reaches it.
"""

from __future__ import annotations

import ast
import threading
from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from hf_tp.adapters.adapter import Adapter, PlanOptions
from hf_tp.adapters.inspect_model import base_model_path
from hf_tp.adapters.text_tower import causal_lm_from_config
from hf_tp.core.forward_source import plain_logits, source_tree
from hf_tp.core.model_source import model_from_config, text_config_of


def refuse(model_type: str, what: str) -> ValueError:
    """The error for a wrapper hf_tp cannot place, naming what."""
    return ValueError(f"hf_tp cannot train this multimodal {model_type} checkpoint: {what}")


_WRAPPERS: dict[str, tuple] = {}  # config JSON -> (lm path, head path, passengers, plain logits, remap)
_BUILDING = threading.Lock()  # building a model sets torch's process-wide default dtype for a while


def wrapper_adapter(config: PretrainedConfig, text: Adapter) -> Adapter:
    """The wrapper's adapter: ``text`` (its language model's) with every plan path re-rooted in the
    wrapper, and the passengers recorded (cached per config)."""
    key = config.to_json_string(use_diff=False)
    with _BUILDING:
        if key not in _WRAPPERS:
            _WRAPPERS[key] = _read(config)
    lm, head, passengers, plain, remap = _WRAPPERS[key]

    def top_plan(opts: PlanOptions):  # the embedding's too: made whole for images by hf_tp.multimodal.passengers
        return {remap(path): style for path, style in text.top_plan(opts).items()}

    return replace(
        text,
        model_type=config.model_type,
        top_plan=top_plan,
        layers_path=remap(text.layers_path),
        check=lambda cfg, tp: _check(config.model_type, text, cfg, tp),
        plain_lm_head=text.plain_lm_head and plain,
        language_model=lm,
        passengers=passengers,
    )


def _check(model_type: str, text: Adapter, config: PretrainedConfig, tp: int) -> None:
    """The text tower's own check, and what hf_tp has not verified on a wrapper."""
    if text.check is not None:
        text.check(config, tp)
    if text.moe and getattr(config, "output_router_logits", False):
        raise ValueError(
            f"this {model_type} checkpoint asks for the router's load-balancing loss (text_config."
            "output_router_logits), which hf_tp has not verified on a multimodal wrapper: set it to False"
        )


def _read(config: PretrainedConfig) -> tuple:
    """Build the wrapper and its text model on meta and find where the language model and the
    lm_head sit: (language model path, lm_head path, passengers, plain logits, path remap)."""
    mt, text_config = config.model_type, text_config_of(config)
    with torch.device("meta"):
        try:
            model = model_from_config(config)
            text_lm = causal_lm_from_config(text_config)
        except Exception as exc:  # noqa: BLE001 - any failure to build means no plan
            first = (str(exc).strip().splitlines() or [""])[0]
            raise refuse(mt, f"its model could not be built from the config ({type(exc).__name__}: {first})") from None
    if _own_loss(model):
        raise refuse(
            mt,
            f"{type(model).__name__}'s forward computes its own cross entropy (over the attention mask's "
            "tokens) instead of transformers' causal-LM loss, which vocab-sharded logits cannot take",
        )
    try:
        prefix = base_model_path(text_lm)  # Llama 4's text model keeps it elsewhere than its prefix says
    except ValueError as exc:
        raise refuse(mt, str(exc).split(": ", 1)[-1]) from None
    base = text_lm.get_submodule(prefix)
    paths = {id(m): n for n, m in model.named_modules()}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    lm = paths.get(id(decoder)) if type(decoder) is type(base) else None
    if lm is None:
        found = [n for n, m in model.named_modules() if type(m) is type(base)]
        if len(found) != 1:
            raise refuse(mt, f"no single {type(base).__name__} (its language model) in {type(model).__name__}")
        lm = found[0]
    head_module = model.get_output_embeddings()
    if head_module is None or id(head_module) not in paths:
        raise refuse(mt, f"{type(model).__name__} has no output embedding (lm_head)")
    head = paths[id(head_module)]
    _same_parameters(mt, model, lm, base, head, text_lm.get_output_embeddings())

    def remap(path: str) -> str:
        if path == paths_in(text_lm, text_lm.get_output_embeddings()):
            return head
        if path.startswith(prefix + "."):
            return lm + path[len(prefix) :]
        raise refuse(mt, f"its language model's plan names {path}, outside {prefix} and the lm_head")

    return lm, head, _passengers(model, (lm, head)), plain_logits(model, head), remap


def paths_in(model: nn.Module, module: nn.Module | None) -> str | None:
    """The path of ``module`` inside ``model`` (None if absent)."""
    return next((n for n, m in model.named_modules() if m is module), None)


def _same_parameters(mt: str, model: nn.Module, lm: str, base: nn.Module, head: str, text_head) -> None:
    """The wrapper's language model and lm_head hold exactly the text model's parameters."""
    for name, p in base.named_parameters():
        try:
            mine = model.get_parameter(f"{lm}.{name}")
        except AttributeError:
            raise refuse(mt, f"its language model at {lm} lacks {name}") from None
        if mine.shape != p.shape:
            raise refuse(mt, f"{lm}.{name} is {tuple(mine.shape)}, its text config gives {tuple(p.shape)}")
    if text_head is None or model.get_submodule(head).weight.shape != text_head.weight.shape:
        raise refuse(mt, f"its lm_head at {head} does not match its text config's")


def _passengers(model: nn.Module, keep: tuple[str, ...]) -> tuple[str, ...]:
    """The top-most modules holding parameters wholly outside ``keep`` (vision tower, projector),
    and the parameters held directly by a module that contains part of ``keep``."""
    out: list[str] = []

    def inside(path: str) -> bool:
        return any(path == k or path.startswith(k + ".") for k in keep)

    def holds(path: str) -> bool:
        return any(k.startswith(path + ".") for k in keep)

    def walk(module: nn.Module, prefix: str) -> None:
        out.extend(prefix + n for n, _ in module.named_parameters(recurse=False) if not inside(prefix + n))
        for name, child in module.named_children():
            path = prefix + name
            if holds(path):
                walk(child, path + ".")
            elif not inside(path) and any(True for _ in child.parameters()):
                out.append(path)

    walk(model, "")
    return tuple(out)


def _own_loss(model: nn.Module) -> bool:
    """The wrapper's forward calls a cross entropy of its own (not ``self.loss_function``)."""
    tree = source_tree(type(model).forward)
    names = {"CrossEntropyLoss", "cross_entropy"}
    return tree is not None and any(
        (isinstance(n, ast.Attribute) and n.attr in names) or (isinstance(n, ast.Name) and n.id in names)
        for n in ast.walk(tree)
    )
