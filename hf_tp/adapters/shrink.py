"""The model ``hf-tp verify`` checks: the user's config cut to a few layers (the shortest run of
layers that holds one of each layer kind) at small widths, keeping what decides the plan.

Kept: the family, head and KV-head counts (what tp splits and replicates), the expert count and
top-k (up to 16 experts: what ep splits), biases, ties, norms, rotary settings and layer kinds.
Shrunk: head widths, hidden and MLP widths (multiples of tp), the vocabulary (above 4096 tokens to
2048 plus its remainder mod 2048, so its divisibility by tp up to 2048 is the same), dropout off.

:func:`shrink_config` shrinks a family's default config whole for the test grids: head counts too,
every width field by one factor per kind, sequence extents (windows, compression, token top-k)
inside the test's rows, so every feature of the published shape runs at a tiny size.
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
    """``num_hidden_layers`` and every per-layer field cut to ``depth``: a list of one entry per
    layer, and a dict keyed by layer index (``per_layer_config``) without the layers cut off."""
    total = config.num_hidden_layers
    out: dict = {"num_hidden_layers": depth}
    for key, value in config.to_dict().items():
        if isinstance(value, list) and len(value) == total and key != "architectures":
            out[key] = value[:depth]
        elif isinstance(value, dict) and value and all(str(k).isdigit() and int(k) < total for k in value):
            out[key] = {k: v for k, v in value.items() if int(k) < depth}
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


# --- A default (published-shape) config shrunk whole: every feature kept, every width scaled together ---

TINY_HEAD = 16  # the widest head-level width of a shrunk config
TINY_HEADS = 4  # attention heads of a shrunk config (other head counts scaled by the same factor)
TINY_HIDDEN = 64  # about the hidden size of a shrunk config whose hidden size is not its heads' width
TINY_EXPERTS = 4
# Integer fields that look like widths but are not: extents along the sequence, kernel sizes, counts.
NOT_WIDTHS = ("vocab", "position", "window", "kernel", "chunk", "max_", "_topk", "pool", "extent", "compress")
EXPERT_GROUPS = ("n_group", "topk_group", "num_expert_group")


def shrink_config(config: PretrainedConfig, tp: int = 2, seq_len: int = 16, **overrides) -> PretrainedConfig:
    """``config`` (a family's default, the published shape) shrunk for a parity test: head counts
    and every width (each ``*_size`` / ``*_dim`` / ``*_rank`` field) divided by one factor per kind
    (head counts, head-level widths, model-level widths), so their ratios hold; sequence extents
    (windows, compression rates, top-k selections) fitted inside ``seq_len``; 4 experts; the depth
    cut to the shortest run of layers holding each layer kind of the full depth. Read from the
    config's fields, so a feature the default switches on stays on (:func:`layer_kinds` is the test).
    ``overrides``: set last."""
    fields = config.to_dict()
    out = _tiny_heads(fields) | _tiny_widths(fields, tp) | _tiny_extents(fields, seq_len) | _tiny_experts(fields)
    out |= _vocab(fields) | {k: 0.0 for k in (*RANDOM, *NOISE) if fields.get(k)}
    out |= dict(initializer_range=0.1, use_cache=False, dtype="float32")
    small = config.__class__.from_dict({**fields, **out, **overrides})
    kinds = layer_kinds(small)
    depth = max(kinds.index(k) for k in set(kinds)) + 1
    return small.__class__.from_dict({**small.to_dict(), **_depth(small, depth), **overrides})


def _pow2_factor(value: float, target: float) -> int:
    """The power of two that brings ``value`` down to about ``target`` (1 when already under it)."""
    return 2 ** max(0, math.ceil(math.log2(value / target))) if value > target else 1


def _is_count(key: str) -> bool:
    return key.endswith(("heads", "_groups")) and not key.startswith(EXPERT_GROUPS)


def _tiny_heads(fields: dict) -> dict:
    """Every head count (and head-group count) divided by the power of two that brings the attention
    heads to 4, none below 1 nor below 2 where it was 2 or more (a grouping stays a grouping)."""
    heads = fields.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        return {}
    g = _pow2_factor(heads, TINY_HEADS)
    return {k: max(min(v, 2), v // g) for k, v in fields.items() if _is_count(k) and type(v) is int and v > 0}


def _is_head_width(key: str) -> bool:
    return "head_dim" in key or "d_head" in key or key == "rotary_dim"


def _is_width(key: str) -> bool:
    return key.endswith(("_size", "_dim", "_rank")) and not any(s in key for s in NOT_WIDTHS)


def _tiny_widths(fields: dict, tp: int) -> dict:
    """Head-level widths divided by one power of two (the widest to 16: a head's parts keep their
    sums and the rotary fraction its pairs), model-level widths by ``hidden_size``'s factor."""
    heads = {k: v for k, v in fields.items() if _is_head_width(k) and type(v) is int and v > 0}
    out: dict = {}
    if heads:
        f = _pow2_factor(max(heads.values()), TINY_HEAD)
        out = {k: max(2, v // f) for k, v in heads.items()}
    hidden = fields.get("hidden_size")
    if not isinstance(hidden, int):
        return out
    n_heads = fields.get("num_attention_heads") or 1
    small_heads = _tiny_heads(fields).get("num_attention_heads", n_heads)
    if "head_dim" in out and hidden == n_heads * fields["head_dim"]:
        small = small_heads * out["head_dim"]  # hidden is the heads' width: it stays so
    elif "head_dim" not in fields and hidden % n_heads == 0:
        small = small_heads * max(2, hidden // n_heads // _pow2_factor(hidden // n_heads, TINY_HEAD))
    else:
        unit = math.lcm(2 * tp, small_heads)
        small = unit * max(1, round(hidden / _pow2_factor(hidden, TINY_HIDDEN) / unit))
    ratio = small / hidden
    for k, v in fields.items():
        if _is_width(k) and not _is_head_width(k) and type(v) is int and v > 0 and k not in out:
            out[k] = max(2 * tp, round(v * ratio / (2 * tp)) * 2 * tp)
    out["hidden_size"] = small
    return out


def _tiny_extents(fields: dict, seq_len: int) -> dict:
    """Windows, compression rates and top-k selections (over tokens, not experts) inside ``seq_len``,
    so a test's rows exercise them: windows to half of it, the rest by one power of two."""
    out: dict = {}
    for k, v in fields.items():
        if "window" in k and isinstance(v, int) and v > seq_len // 2:
            out[k] = max(2, seq_len // 2)
        elif "compress" in k and "rope" not in k and isinstance(v, dict) and v:
            f = _pow2_factor(max(v.values()), seq_len // 2)
            out[k] = {name: max(2, r // f) for name, r in v.items()}
        elif k.endswith("topk") and k not in TOP_K and isinstance(v, int) and v > seq_len // 4:
            out[k] = max(2, seq_len // 4)
    return out


def _tiny_experts(fields: dict) -> dict:
    """4 experts (every count field), at most 2 per token, one expert group."""
    out = {k: TINY_EXPERTS for k in EXPERT_COUNTS if isinstance(fields.get(k), int) and fields[k] > TINY_EXPERTS}
    if out:
        out |= {k: 1 for k in EXPERT_GROUPS if fields.get(k)}
        out |= {k: min(fields[k], 2) for k in TOP_K if isinstance(fields.get(k), int)}
    return out
