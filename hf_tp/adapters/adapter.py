"""What an adapter is: the plans of one model family and the sizes tensor parallelism splits.

An adapter is data, not a model subclass: two functions that return plans (plain dicts of module
path -> ``ParallelStyle``) plus the config fields that tp must divide. The family table's
hand-written plans build one (:mod:`hf_tp.adapters.families`); :mod:`hf_tp.adapters.generic` derives one from a model; :mod:`hf_tp.adapters.registry`
finds the right one for a config.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed.tensor.parallel import ParallelStyle
from transformers import PretrainedConfig

from hf_tp.adapters.quantized import check_not_quantized

Plan = dict[str, ParallelStyle]


@dataclass(frozen=True)
class PlanOptions:
    """Switches that change the plan an adapter returns."""

    sequence_parallel: bool = True
    loss_parallel: bool = True
    # tp ranks that share each KV head: tp / num_key_value_heads when tp is larger, else 1.
    kv_replicas: int = 1


@dataclass(frozen=True)
class Adapter:
    """How to tensor-parallelize one model family (one ``config.model_type``).

    Attributes:
        model_type: the ``config.model_type`` this adapter serves (``"llama"``, ``"qwen2"``...).
        layer_plan: options -> plan for one decoder layer, paths relative to the layer.
        top_plan: options -> plan for the modules outside the layers (embedding, final norm,
            lm_head), paths relative to the ``*ForCausalLM`` model.
        layers_path: dotted path of the ``ModuleList`` of decoder layers.
        split_fields: config fields that tp shards and must therefore divide (head counts, the
            MLP width).
        check: optional extra validation ``(config, tp) -> None`` that raises ``ValueError``.
        moe: the plan runs mixture-of-experts blocks as expert-tensor-parallel regions.
        plain_lm_head: the logits are exactly ``lm_head(get_decoder()(...).last_hidden_state)``
            (no logit scaling), so the training loop may fuse the lm_head with the loss
            (:func:`hf_tp.parallel.linear_ce.causal_lm_loss`). A config with
            ``final_logit_softcapping`` set (Gemma 2) is never fused, whatever the adapter says.
        language_model, passengers: set for a multimodal wrapper (:mod:`hf_tp.adapters.wrapper`):
            where its language model sits, and what lies outside it and the lm_head.
    """

    model_type: str
    layer_plan: Callable[[PlanOptions], Plan]
    top_plan: Callable[[PlanOptions], Plan]
    layers_path: str = "model.layers"
    split_fields: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    check: Callable[[PretrainedConfig, int], None] | None = field(default=None)
    plain_lm_head: bool = False
    moe: bool = False  # some layers run mixture-of-experts blocks (hf_tp.moe.expert_styles)
    experts: tuple[str, ...] = ()  # the experts modules, relative to a decoder layer (for expert parallelism)
    # the layers flatten batch and sequence themselves for modules they call (Gemma 4's own experts):
    # their one-token steps need a gather first (hf_tp.parallel.one_token)
    flattens_tokens: bool = False
    # the layers flatten the residual's tokens and view them back around an MLP they run themselves
    # (OPT): both reshapes done on the rank's own tokens (hf_tp.parallel.flat_tokens)
    local_token_reshapes: bool = False
    # a derived plan whose projections were read from the model's modules and forwards, transformers
    # having no tp plan for the family (hf_tp.adapters.inspect_plan); else from transformers' plan
    read_from_modules: bool = False
    language_model: str = ""  # a multimodal wrapper's language model (hf_tp.adapters.wrapper)
    passengers: tuple[str, ...] = ()  # a wrapper's modules and parameters outside it and its lm_head

    def layers_config(self, config: PretrainedConfig) -> PretrainedConfig:
        """The config of the layers the plan splits: a wrapper's ``text_config``, else ``config``."""
        return (getattr(config, "text_config", None) or config) if self.language_model else config

    def is_passenger(self, name: str) -> bool:
        """``name`` (a parameter or module path) lies outside the language model and its lm_head."""
        return any(name == p or name.startswith(p + ".") for p in self.passengers)

    def split_sizes(self, config: PretrainedConfig) -> dict[str, int]:
        """The sizes that tp must divide, read from ``config``."""
        config = self.layers_config(config)
        sizes = {}
        for name in self.split_fields:
            value = getattr(config, name, None)
            if value is None and name == "num_key_value_heads":
                value = config.num_attention_heads  # HF's default: plain multi-head attention
            if value is None:
                raise ValueError(f"{self.model_type} config has no '{name}', which the TP plan splits")
            sizes[name] = int(value)
        return sizes

    def valid_tp_sizes(self, config: PretrainedConfig) -> list[int]:
        """Every tp that divides all split sizes of this model, except that the KV heads may also
        divide tp (each then replicated on tp / num_key_value_heads ranks)."""
        sizes = self.split_sizes(config)
        g = 0
        for name, value in sizes.items():
            if name != "num_key_value_heads":
                g = math.gcd(g, value)
        kv = sizes.get("num_key_value_heads")
        return [d for d in range(1, g + 1) if g % d == 0 and (kv is None or kv % d == 0 or d % kv == 0)]

    def kv_replicas(self, config: PretrainedConfig, tp: int) -> int:
        """How many tp ranks share each KV head (1 unless tp > num_key_value_heads)."""
        config = self.layers_config(config)
        kv = self.split_sizes(config).get("num_key_value_heads")
        return tp // kv if kv is not None and tp > kv else 1

    def validate(self, config: PretrainedConfig, tp: int) -> None:
        """Raise a ``ValueError`` naming the model's numbers if ``tp`` does not fit this model, or
        naming the fix if the checkpoint is quantized (:mod:`hf_tp.adapters.quantized`)."""
        check_not_quantized(config)
        config = self.layers_config(config)
        if tp < 1:
            raise ValueError(f"tp must be a positive integer, got tp={tp}")
        valid = ", ".join(str(v) for v in self.valid_tp_sizes(config))
        for name, value in self.split_sizes(config).items():
            if name == "num_key_value_heads" and tp > value and tp % value == 0:
                continue  # fewer KV heads than ranks: each one replicated on tp / kv ranks
            if value % tp != 0:
                also = " (or be a multiple of it)" if name == "num_key_value_heads" else ""
                raise ValueError(
                    f"tp must divide {name} ({value}){also} of this {self.model_type} model, got tp={tp}; "
                    f"valid tp values for it are: {valid}"
                )
        if self.check is not None:
            self.check(config, tp)
