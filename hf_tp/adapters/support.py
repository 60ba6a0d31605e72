"""Which families the generic plan serves and which hf_tp refuses, as the family grid found them.

Kept true by the parity grid: tests/unit/test_family_grid.py runs every dense family of the
installed transformers and checks each entry here (parity for GENERIC, a refusal naming the reason
for REFUSED); scripts/family_grid.py regenerates docs/architectures.md from the same runs.
TEXT_TOWERS (language models transformers builds only inside a wrapper) are kept true by the
wrapper and image grids (tests/wrapper_grid.py, tests/image_grid.py). A family
in neither table (a newer transformers) still goes through the generic derivation, which holds
parity or refuses with a reason of its own. Data only: this module imports nothing.
"""

from __future__ import annotations

# model_type -> what the generic plan handles in it (docs/architectures.md shows it)
GENERIC: dict[str, str] = {
    "apertus": "xIELU activation with learned scalars (replicated, gradients summed over tp); per-head q/k norms",
    "apertus1p5_text": "xIELU activation with learned scalars; per-head q/k norms; MLP without a gate",
    "arcee": "ReLU^2 MLP without a gate",
    "bamba": "layer plan written by hf_tp (adapters/families.py); Mamba-2 layers run whole on every rank",
    "cohere": "attention and MLP in parallel from one LayerNorm; logits scaled (not fused)",
    "cohere2": "parallel attention + MLP; sliding-window layers; logits scaled (not fused)",
    "cohere_compass_text": "Cohere layout (parallel attention + MLP); logits scaled (not fused)",
    "cwm": "Llama layout, sliding-window layers",
    "codegen": "packed qkv_proj in 4 head groups (tp must divide 4); parallel attention + MLP; interleaved partial rotary",
    "ernie4_5": "Llama layout",
    "exaone": "Llama layout",
    "falcon_h1": "layer plan written by hf_tp; Mamba-2 mixer (whole on every rank) beside attention; multipliers",
    "gemma4_unified_text": "Gemma layout; per-layer head sizes read from the attention modules",
    "glm": "packed gate_up_proj run gathered (transformers' colwise_gather_output: the MLP's middle is whole on every rank)",
    "glm4": "as GLM, with post-attention and post-MLP norms",
    "exaone4": "norms after attention and MLP; per-head q/k norms",
    "gpt_neox": "packed query_key_value interleaved per head (column-parallel as is); parallel residual; partial rotary",
    "gptj": "parallel attention + MLP from one LayerNorm; interleaved partial rotary; lm_head bias (not fused)",
    "granite": "embedding, residual and attention multipliers; logits scaled (not fused)",
    "granite_swa": "per-head attention sinks sharded with the heads; multipliers; logits scaled (not fused)",
    "helium": "Llama layout",
    "hyperclovax": "Granite-style multipliers",
    "hunyuan_v1_dense": "layer plan written by hf_tp; per-head q/k norms",
    "internlm3": "Llama layout",
    "iquestcoder": "Llama layout",
    "jais2": "LayerNorm with bias, ReLU^2 MLP",
    "lfm2": "layer plan written by hf_tp; short-convolution layers run whole on every rank; per-head q/k norms",
    "lfm3": "as LFM2, with per-head output gates (g_proj) split with the heads",
    "ministral": "Llama layout, sliding-window layers",
    "ministral3": "Llama layout",
    "nanochat": "parameter-free norms, ReLU^2 MLP",
    "nemotron": "LayerNorm1P with bias, ReLU^2 MLP, partial rotary",
    "olmo": "parameter-free LayerNorm",
    "olmo_hybrid": "linear-attention layers run whole on every rank (their parameters replicated); gathered attention with full-width q/k norms",
    "olmo2": "q/k norms over the whole projection width (hand-written overrides: adapters/families.py)",
    "olmo3": "as OLMo 2, with sliding-window layers",
    "phi3": "packed qkv_proj and gate_up_proj run gathered: attention and MLP middle whole on every rank (correct, more communication)",
    "phi": "parallel attention + MLP from one LayerNorm; biases everywhere; partial rotary; lm_head bias (not fused)",
    "qwen3_5_text": "gated delta-net layers run whole on every rank (their parameters replicated); per-head q/k norms",
    "seed_oss": "Llama layout with attention biases",
    "smollm3": "no rotary embedding on every fourth layer",
    "starcoder2": "LayerNorm with bias, biased projections, GELU MLP without a gate",
    "vaultgemma": "Gemma layout (scaled embedding, (1 + w) norms), soft-capped logits (not fused)",
    "minicpm3": "latent attention (low-rank q and kv projections) runs whole on every rank, its parameters replicated",
    "youtu": "latent attention (no tp plan for it) runs whole on every rank, its parameters replicated",
    # transformers gives these no tp plan: the projections are read from the modules (adapters/inspect_plan.py)
    "opt": "plan read from its modules (transformers has none); its layer runs fc1/fc2 itself on flattened tokens "
    "(fc1 gathers its input, fc2 all-reduced); learned positions replicated; num_heads set to the rank's heads",
    "xglm": "plan read from its modules; its layer runs fc1/fc2 itself; sinusoidal positions handed on as sequence "
    "shards; scaled embedding; num_heads and embed_dim set to the rank's heads",
    "biogpt": "plan read from its modules; its layer runs fc1/fc2 itself; learned positions replicated; scaled embedding",
    "gpt_neo": "plan read from its modules; global and local (windowed) attention layers; the position embedding "
    "vocab-sharded as the token one; num_heads set to the rank's heads",
    "stablelm": "plan read from its modules; partial rotary; KV heads replicated when tp exceeds them; num_heads and "
    "num_key_value_heads set to the rank's (its optional per-head q/k LayerNorms, qk_layernorm, are refused)",
    "persimmon": "plan read from its modules; query_key_value packs q, k and v head by head (its forward views it as "
    "(num_heads, 3, head_dim)), so it splits by heads as is; per-head q/k LayerNorms; partial rotary",
    "gemma4_text": "per-layer embeddings vocab-sharded as the input embedding, their projections run per token on sequence shards (replicated); its MoE variant (enable_moe_block=True: the layer calls router and experts itself on flattened tokens) runs the experts as an expert-TP region, router and norms per token",
}

# Mixture-of-experts families: model_type -> what the generic plan handles in it. Every MoE block
# runs as one expert-tensor-parallel region (hf_tp/moe/expert_styles.py): experts split on their
# intermediate dim, routers replicated, aux-loss gradient exact; the notes say what else.
MOE: dict[str, str] = {
    "afmoe": "shared experts; dense first layer (its MLP runs whole on every rank)",
    "aria_text": "shared experts; experts stored transposed",
    "beam": "per-head attention sinks; q/k norms",
    "cohere2_moe": "parallel attention + MoE; sliding-window layers",
    "deepseek_v2": "shared experts; latent attention runs whole on every rank",
    "deepseek_v3": "shared experts; group-limited routing with score-correction bias; dense first layer; latent attention runs whole on every rank",
    "deepseek_v32": "as DeepSeek-V3, with its indexer (latent attention runs whole on every rank)",
    "dots3_note_text": "shared experts",
    "ernie4_5_moe": "shared experts; router statistics replicated",
    "exaone_moe": "shared experts; dense first layer",
    "flex_olmo": "gathered attention (transformers' colwise_gather_output); full-width q/k norms",
    "flint": "dense layers from mlp_only_layers",
    "glm4_moe": "shared experts; dense first layer",
    "glm4_moe_lite": "shared experts; latent attention runs whole on every rank",
    "glm_moe_dsa": "shared experts; latent attention with its indexer runs whole on every rank",
    "gpt_oss": "tp plan written by hf_tp (adapters/families.py: transformers has none); per-head attention sinks; experts stored transposed with interleaved gate/up columns and biases; router with a bias",
    "granitemoe": "attention (not in its tp plan) runs whole on every rank; multipliers",
    "granitemoe_swa": "per-head attention sinks; sliding-window layers",
    "granitemoehybrid": "Mamba layers run whole on every rank",
    "granitemoeshared": "shared experts; multipliers",
    "hunyuan_v1_moe": "shared expert; per-head q/k norms",
    "hy_v3": "shared experts; dense first layer",
    "jamba": "Mamba layers run whole on every rank; MoE every other layer",
    "kolibri1": "shared experts",
    "kolibri1_1": "shared expert; dense first layers; sliding-window and indexed (top-k key selection) attention layers (transformers >= 5.25)",
    "lara_mini": "linear-attention layers run whole on every rank (gathered out_proj); shared expert; per-head q/k norms",
    "param2moe": "shared experts; dense first layer (transformers >= 5.25)",
    "laguna": "score-correction bias (no gradient); dense first layer",
    "mellum": "sliding-window layers",
    "minimax_m2": "gathered attention with full-width q/k norms",
    "mixtral": "Mixtral layout",
    "olmoe": "gathered attention with full-width q/k norms",
    "phimoe": "sparse-mixer routing",
    "qwen2_moe": "shared expert with a sigmoid gate",
    "qwen3_5_moe_text": "gated delta-net layers run whole on every rank; shared expert with a sigmoid gate",
    "qwen3_moe": "q/k norms",
    "qwen3_next": "gated delta-net layers run whole on every rank; shared expert with a sigmoid gate",
    "sarvam_mla": "shared experts; dense layers; latent attention runs whole on every rank",
    "sarvam_moe": "shared experts; dense layers; per-head q/k norms",
    "solar_open": "shared experts",
    "axk2": "shared experts; latent attention with its indexer runs whole; a gated norm on MoE layers (a plain norm on the dense one) runs whole",
    "llama4_text": "decoder found from the model (its base_model_prefix names no module); shared expert; dense layers interleaved; every expert runs on every token, so ep is refused",
    "mimo_v2_flash": "value heads wider than query heads; per-head sinks on sliding-window layers only; KV heads change by layer (tp <= num_key_value_heads)",
    "mistral4": "built as transformers' Mistral4ForCausalLM (registered with AutoModelForCausalLM: transformers maps it under image-text-to-text only); latent attention runs whole; shared experts",
    "kimi_linear": "linear-attention (KDA) and latent-attention layers under one name (self_attn), both run whole on every rank; shared experts; dense first layer",
    "axk1": "shared experts; latent attention runs whole; a norm on the MoE block's output (the region is summed at its input, the norm sequence parallel)",
    "dots1": "shared experts; dense first layer",
    "inkling_text": "normed embedding (its norm runs after the vocab reduction, sequence parallel); packed gate_up experts that its plan calls colwise read as packed; shared experts stored as 3-D stacks split as experts; attention (no tp plan) and short convolutions run whole",
    "minimax_m3_vl_text": "gathered attention; a packed shared-expert gate_up_proj Linear split as its experts' packed_colwise (gate and up halves, each split)",
    "lfm2_moe": "layer plan written by hf_tp (its plan names only the experts): LFM2's attention and dense layers around MoE blocks; short-convolution layers run whole",
    "bailing_hybrid": "linear-attention and latent-attention layers under one name (self_attn), both run whole on every rank; shared experts; dense first layer",
    "nemotron_h": "one mixer per layer, Mamba-2 (whole on every rank), attention, ReLU^2 MLP or MoE by layer index: each layer's mixer gets its kind's plan (attention and MLP projections named by hf_tp)",
    "minimax": "lightning linear attention (whole on every rank) and softmax attention (split by heads) under one name (self_attn), each layer's by its kind; fp32 only (its fp32 decay buffers break bf16 mixed precision)",
    "deepseek_v4": "hyper-connections: the residual's streams sequence-parallel, their mixers (attn_hc, ffn_hc, hc_head) replicated, run per token on each rank's shard, gradients summed over tp; attention runs whole; hash-routed and learned-router MoE layers",
    "qwen4_exp_text": "hyper-connections on a flattened residual (streams sequence-parallel; gated residual mixers replicated per token, gradients summed over tp, transformers' split of their down projection not used); gated delta-net and indexed attention run whole; shared expert with a sigmoid gate; per-layer n-gram embeddings (ple_layer_ids) refused",
    "hy_v4": "hyper-connections as DeepSeek-V4's (streams sequence-parallel, mixers replicated per token, gradients summed over tp); latent attention with sinks and indexer runs whole; shared experts",
}

# model_type -> why hf_tp refuses it (the error message names this reason)
REFUSED: dict[str, str] = {
    "phi4_multimodal": "a multimodal model: its image and audio encoders sit outside the decoder layers with no plan",
    "gemma3n_text": "its residual stream is 4 AltUp streams stacked ahead of the batch ([altup, batch, seq, hidden]: the sequence is dim 2, not the dim 1 that sequence parallelism splits) and its MLP's activation sparsity takes the mean and std over the whole intermediate width that tp splits; train it with plain FSDP2 or DDP",
    "hrm_text": "two nested decoder stacks (H and L modules) called in a recurrent loop",
    "llama4": "a multimodal wrapper whose own forward (Llama4ForConditionalGeneration) fails in plain transformers: it reads image_outputs from its language model's output, which has none (AttributeError on every call); llama4_text trains on its own",
    "doge": "a learned residual scale on the decoder layer and a routed MLP (router gate and expert embeddings)",
    # mixture-of-experts families
    "longcat_flash": "two attention and two MLP sublayers per decoder layer held in ModuleLists that the layer indexes itself (self_attn[0], mlps[1], input_layernorm[0], ...), which the generic plan cannot read (it reads a layer's blocks as its named children); its MoE block also has zero-computation (identity) experts, whose whole output every tp rank would add once; train it with plain FSDP2 or DDP",
    "inkling2_text": "block attention residuals: each layer's attention_input / mlp_input (Inkling2BlockAttentionResidual) attends over a stack of earlier blocks' outputs that the model carries from layer to layer as an extra argument (block_states), which hf_tp cannot yet place on sequence shards; train it with plain FSDP2 or DDP",
}

# Decoders transformers gives no tp plan that reading the plan from their modules refuses
# (adapters/inspect_plan.py): model_type -> the reason the refusal names (tests/unit/test_family_grid.py)
READ_REFUSED: dict[str, str] = {
    "gpt2": "attn.c_attn is a Conv1D (GPT-2's Conv1D stores its weight transposed), not a plain nn.Linear the plan "
    "can split; it packs q, k and v",
    "falcon": "self_attention.query_key_value is a FalconLinear, an nn.Linear with a forward of its own, not a plain "
    "nn.Linear the plan can split; it packs q, k and v",
    "bloom": "it adds ALiBi biases built for every attention head in the base model",
    "mpt": "it adds ALiBi biases built for every attention head in the base model",
    "gpt_bigcode": "attn.c_attn is a fused q/k/v projection",
    "trocr": "its decoder layer calls encoder_attn with an encoder's states (cross-attention)",
}

# Language models with no causal LM of their own in transformers (a bare *TextModel, the lm_head in
# the wrapper), trained inside their wrapper only: model_type -> what the generic plan handles in it
# (the wrapper grid and the image grid hold them at parity)
TEXT_TOWERS: dict[str, str] = {
    "qwen2_vl_text": "Qwen2 layers; 3-D mrope positions built by the wrapper from the whole sequence",
    "qwen2_5_vl_text": "Qwen2 layers; 3-D mrope positions built by the wrapper from the whole sequence",
    "qwen3_vl_text": "Qwen3 layers (hf_tp's plan: transformers' names only the embedding); 3-D interleaved mrope; "
    "DeepStack visual features added on sequence shards",
    "qwen3_vl_moe_text": "Qwen3-MoE layers; 3-D interleaved mrope; DeepStack visual features added on sequence shards",
    "glm4v_text": "GLM-4 layers (packed gate_up_proj run gathered); 3-D mrope positions",
    "glm4v_moe_text": "GLM-4.5 MoE layers with shared experts; partial 3-D mrope positions",
}

# model_type -> why bf16 mixed precision (FSDP2: bf16 compute, fp32 master weights and buffers)
# cannot train it; fp32 can (the refusal says so)
MIXED_PRECISION_REFUSED: dict[str, str] = {
    "minimax": "its lightning attention multiplies its fp32 decay buffers with bf16 activations and then "
    "matmuls the fp32 result with a bf16 state (RuntimeError: expected scalar type Float but found BFloat16)",
}

# Multimodal wrappers refused before their language model is looked at: model_type -> why (the
# error message is this one line, naming the wrapper). None today: Qwen2.5-VL / Qwen3-VL, refused
# until their 3-D mrope positions and DeepStack features were checked under sequence parallelism,
# hold parity (docs/multimodal.md).
WRAPPER_REFUSED: dict[str, str] = {}
