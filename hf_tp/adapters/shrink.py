"""The model ``hf-tp verify`` checks: the user's config cut to a few layers (the shortest run of
layers that holds one of each layer kind) at small widths, keeping what decides the plan.

Kept: the family, head and KV-head counts (what tp splits and replicates), the expert count and
top-k (up to 16 experts: what ep splits), biases, ties, norms, rotary settings and layer kinds.
Shrunk: head widths, hidden and MLP widths (multiples of tp), the vocabulary (above 4096 tokens to
2048 plus its remainder mod 2048, so its divisibility by tp up to 2048 is the same), dropout off.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig

HEAD = 16  # head width of the cut model (narrower for models of over 32 heads: a hidden size of 512)
MAX_EXPERTS = 16
BIG_VOCAB = 4096
MAX_HIDDEN = 512
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token")
# Randomness a sharded run cannot reproduce draw for draw (dropout masks, router noise): off.
RANDOM = ("attention_dropout", "hidden_dropout", "residual_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")
NOISE = ("router_jitter_noise", "input_jitter_noise")


def cut_config(config: PretrainedConfig, tp: int, seq_len: int) -> PretrainedConfig:
    """A copy of ``config`` at small widths, cut to the shortest run of layers holding one layer of
    each kind its full depth has (a ``ValueError`` naming why when it cannot be cut)."""
    small = config.__class__.from_dict({**config.to_dict(), **_widths(config, tp, seq_len)})
    kinds = layer_kinds(small)
    depth = max(kinds.index(k) for k in set(kinds)) + 1
    cut = small.__class__.from_dict({**small.to_dict(), **_depth(small, depth)})
    got = layer_kinds(cut)
    if got != kinds[:depth]:
        raise ValueError(
            f"cannot cut {config.model_type} to {depth} layers keeping its layer kinds ({len(set(kinds))} kinds "
            f"in {len(kinds)} layers, the cut model builds {len(set(got))}): verify needs a config whose layer "
            "pattern follows num_hidden_layers"
        )
    return cut


def layer_kinds(config: PretrainedConfig) -> list[str]:
    """One label per decoder layer: its ``layer_types`` entry and the classes of its modules, so
    two layers share a label exactly when they are built alike (a meta model: no memory)."""
    from hf_tp.adapters import get_adapter
    from hf_tp.core.model_source import model_from_config

    with torch.device("meta"):
        model = model_from_config(config)
    types = getattr(config, "layer_types", None) or []
    layers = model.get_submodule(get_adapter(config).layers_path)
    return [f"{types[i] if i < len(types) else ''}:{_structure(layer)}" for i, layer in enumerate(layers)]


def _structure(layer: nn.Module) -> str:
    return ",".join(f"{name}={type(m).__name__}" for name, m in layer.named_modules())


def _depth(config: PretrainedConfig, depth: int) -> dict:
    """``num_hidden_layers`` and every per-layer list field cut to ``depth``."""
    total = config.num_hidden_layers
    out: dict = {"num_hidden_layers": depth}
    for key, value in config.to_dict().items():
        if isinstance(value, list) and len(value) == total and key != "architectures":
            out[key] = value[:depth]
    return out


def _widths(config: PretrainedConfig, tp: int, seq_len: int) -> dict:
    """The small sizes, each only where the config has the field."""
    fields = config.to_dict()
    heads = config.num_attention_heads
    head = max(4, min(HEAD, MAX_HIDDEN // heads) // 2 * 2)  # even: rotary pairs
    hidden = max(64, heads * head)
    out = dict(hidden_size=hidden, initializer_range=0.1, use_cache=False, dtype="float32")
    width = math.lcm(2 * hidden, tp)
    out |= {k: width for k in ("intermediate_size", "ffn_hidden_size") if fields.get(k)}
    out |= {k: math.lcm(32, tp) for k in ("moe_intermediate_size",) if fields.get(k)}
    out |= {k: math.lcm(64, tp) for k in ("shared_expert_intermediate_size",) if fields.get(k)}
    if fields.get("head_dim"):
        out["head_dim"] = head
    if "kv_lora_rank" in fields:  # latent attention (DeepSeek-style): head_dim is the rotary part or the whole head
        mla = dict(qk_rope_head_dim=head, qk_nope_head_dim=head, v_head_dim=head, kv_lora_rank=32, q_lora_rank=48)
        out |= {k: v for k, v in mla.items() if k in fields and (fields[k] is not None or k != "q_lora_rank")}
        whole = (fields.get("qk_nope_head_dim") or 0) + (fields.get("qk_rope_head_dim") or 0)
        out["head_dim"] = 2 * head if fields.get("head_dim") == whole else head
    out |= _experts(fields)
    out |= _vocab(fields)
    out |= {k: 0.0 for k in (*RANDOM, *NOISE) if fields.get(k)}
    window = fields.get("sliding_window")
    if isinstance(window, int) and window > seq_len // 2:  # a window the check's rows actually exceed
        out["sliding_window"] = max(2, seq_len // 2)
    return out


def _experts(fields: dict) -> dict:
    out = {}
    for key in EXPERT_COUNTS:
        if isinstance(fields.get(key), int) and fields[key] > MAX_EXPERTS:
            out[key] = MAX_EXPERTS
    if out:
        out |= {k: 1 for k in ("n_group", "topk_group", "num_expert_group") if fields.get(k)}
        out |= {k: min(fields[k], MAX_EXPERTS // 2) for k in TOP_K if isinstance(fields.get(k), int)}
    return out


def _vocab(fields: dict) -> dict:
    vocab = fields.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= BIG_VOCAB:
        return {}
    small = BIG_VOCAB // 2 + vocab % (BIG_VOCAB // 2)
    out: dict = {"vocab_size": small}
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = fields.get(key)
        if isinstance(value, int) and value >= small:
            out[key] = small - 1 - ("bos" in key) - 2 * ("eos" in key)
        elif isinstance(value, list):
            out[key] = [v if v < small else small - 3 for v in value]
    return out
