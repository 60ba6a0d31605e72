"""Which families the generic plan serves and which hf_tp refuses, as the family grid found them.

Kept true by the parity grid: tests/unit/test_family_grid.py runs every dense family of the
installed transformers and checks each entry here (parity for GENERIC, a refusal naming the reason
for REFUSED); scripts/family_grid.py regenerates docs/architectures.md from the same runs. A family
in neither table (a newer transformers) still goes through the generic derivation, which holds
parity or refuses with a reason of its own.
"""

from __future__ import annotations

# model_type -> what the generic plan handles in it (docs/architectures.md shows it)
GENERIC: dict[str, str] = {
    "apertus": "xIELU activation with learned scalars (replicated, gradients summed over tp); per-head q/k norms",
    "arcee": "ReLU^2 MLP without a gate",
    "cohere": "attention and MLP in parallel from one LayerNorm; logits scaled (not fused)",
    "cohere2": "parallel attention + MLP; sliding-window layers; logits scaled (not fused)",
    "cohere_compass_text": "Cohere layout (parallel attention + MLP); logits scaled (not fused)",
    "cwm": "Llama layout, sliding-window layers",
    "ernie4_5": "Llama layout",
    "gemma4_unified_text": "Gemma layout; per-layer head sizes read from the attention modules",
    "glm": "packed gate_up_proj run gathered (transformers' colwise_gather_output: the MLP's middle is whole on every rank)",
    "glm4": "as GLM, with post-attention and post-MLP norms",
    "exaone4": "norms after attention and MLP; per-head q/k norms",
    "gpt_neox": "packed query_key_value interleaved per head (column-parallel as is); parallel residual; partial rotary",
    "granite": "embedding, residual and attention multipliers; logits scaled (not fused)",
    "granite_swa": "per-head attention sinks sharded with the heads; multipliers; logits scaled (not fused)",
    "helium": "Llama layout",
    "hyperclovax": "Granite-style multipliers",
    "internlm3": "Llama layout",
    "iquestcoder": "Llama layout",
    "jais2": "LayerNorm with bias, ReLU^2 MLP",
    "ministral": "Llama layout, sliding-window layers",
    "ministral3": "Llama layout",
    "nanochat": "parameter-free norms, ReLU^2 MLP",
    "nemotron": "LayerNorm1P with bias, ReLU^2 MLP, partial rotary",
    "olmo": "parameter-free LayerNorm",
    "olmo_hybrid": "linear-attention layers run whole on every rank (their parameters replicated); gathered attention with full-width q/k norms",
    "olmo2": "q/k norms over the whole projection width (hand-written overrides: adapters/olmo2.py)",
    "olmo3": "as OLMo 2, with sliding-window layers",
    "phi3": "packed qkv_proj and gate_up_proj run gathered: attention and MLP middle whole on every rank (correct, more communication)",
    "phi": "parallel attention + MLP from one LayerNorm; biases everywhere; partial rotary; lm_head bias (not fused)",
    "qwen3_5_text": "gated delta-net layers run whole on every rank (their parameters replicated); per-head q/k norms",
    "seed_oss": "Llama layout with attention biases",
    "smollm3": "no rotary embedding on every fourth layer",
    "starcoder2": "LayerNorm with bias, biased projections, GELU MLP without a gate",
    "vaultgemma": "Gemma layout (scaled embedding, (1 + w) norms), soft-capped logits (not fused)",
}

# model_type -> why hf_tp refuses it (the error message names this reason)
REFUSED: dict[str, str] = {
    "phi4_multimodal": "a multimodal model: its image and audio encoders sit outside the decoder layers with no plan",
    "minicpm3": "multi-head latent attention (low-rank q and kv projections) is not supported",
    "youtu": "multi-head latent attention (low-rank q and kv projections) is not supported",
    "gemma3n_text": "per-layer embeddings, AltUp and KV sharing across layers have no TP+SP plan here",
    "hrm_text": "two nested decoder stacks (H and L modules) called in a recurrent loop",
    "llama4": "a multimodal model (its tp plan shards the vision projector); train llama4_text MoE under issue 14",
    "doge": "a learned residual scale on the decoder layer and a routed MLP (router gate and expert embeddings)",
}


def tensor_parallel_causal_lm_types() -> dict[str, bool]:
    """Every causal-LM ``model_type`` of the installed transformers whose config carries a
    ``base_model_tp_plan``, mapped to whether it is a mixture of experts (its plan shards experts)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            plan = getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)
        except KeyError:
            continue
        if plan:
            out[model_type] = any("expert" in key for key in plan)
    return out
