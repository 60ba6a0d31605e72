"""Layer plans hf_tp writes for families whose transformers plan shards only the embedding (or the experts).

transformers (5.24) ships these with ``base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}``:
its TP leaves every decoder layer whole. Their layers are Megatron-shaped, so the generic
derivation needs only the projections named; it reads the rest off the modules as for any family
(per-head q/k norms, per-head output gates, Mamba and short-convolution mixers that run whole on
every rank with their parameters replicated). Each holds parity with plain HF at tp=2 and tp=4 in
the family grid.

- Hunyuan-V1-Dense: Llama layout, per-head ``query_layernorm``/``key_layernorm``;
- LFM2: attention layers (``out_proj``, per-head norms) mixed with short-convolution layers;
  SwiGLU ``feed_forward`` as ``w1`` (gate), ``w3`` (up), ``w2`` (down); LFM2-MoE (whose plan
  names only its experts) the same around its MoE blocks;
- LFM3: as LFM2, plus ``g_proj``, one sigmoid output gate per query head (split with the heads);
- Bamba, Falcon-H1: Mamba-2 mixers (whole) beside attention, a gated ``feed_forward``;
- Nemotron-H: one ``mixer`` per layer that is Mamba-2, attention, a ReLU^2 MLP or a MoE block by
  layer index; transformers' plan names only the experts, hf_tp adds the attention and MLP
  projections (each layer's mixer gets its kind's plan: :mod:`hf_tp.adapters.mixers`).
"""

from hf_tp.adapters.overrides import register_plan_overrides


def _attention(out: str = "o_proj") -> dict[str, str]:
    qkv = {f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")}
    return {**qkv, f"layers.*.self_attn.{out}": "rowwise"}


def _mlp(block: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> dict[str, str]:
    return {
        f"layers.*.{block}.{gate}": "colwise",
        f"layers.*.{block}.{up}": "colwise",
        f"layers.*.{block}.{down}": "rowwise",
    }


register_plan_overrides(("hunyuan_v1_dense",), {**_attention(), **_mlp("mlp")})
register_plan_overrides(("lfm2",), {**_attention("out_proj"), **_mlp("feed_forward", "w1", "w3", "w2")})
# LFM2-MoE: transformers' plan names only the experts; its attention and dense layers are LFM2's
register_plan_overrides(("lfm2_moe",), {**_attention("out_proj"), **_mlp("feed_forward", "w1", "w3", "w2")})
register_plan_overrides(
    ("lfm3",),
    {**_attention(), "layers.*.self_attn.g_proj": "colwise", **_mlp("feed_forward", "w1", "w3", "w2")},
)
register_plan_overrides(("bamba", "falcon_h1"), {**_attention(), **_mlp("feed_forward")})
register_plan_overrides(
    ("nemotron_h",),
    {
        **{f"layers.*.mixer.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj", "up_proj")},
        **{f"layers.*.mixer.{p}": "rowwise" for p in ("o_proj", "down_proj")},
    },
)
