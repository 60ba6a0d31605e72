"""Run the family grid and write docs/architectures.md from it.

For every dense causal-LM family of the installed transformers: tp=2 parity with plain HF on a tiny
random model of its own config class (tests/family_grid.py, the same runs the test suite makes), the
valid tp sizes of its default (published) shape, and what is special about it or why it is refused.

    OMP_NUM_THREADS=1 python scripts/family_grid.py [--out docs/architectures.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HAND_WRITTEN = {
    "llama": "hand-written (adapters/families.py): the reference Megatron TP+SP plan",
    "qwen2": "hand-written: Llama's plan, q/k/v biases",
    "mistral": "hand-written: Llama's plan, sliding window",
    "qwen3": "hand-written: per-head q/k norms",
    "gemma": "hand-written: scaled embedding after its reduce-scatter",
    "gemma2": "hand-written: four norms per layer, soft-capped logits (not fused)",
    "gemma3_text": "hand-written: Gemma 2's plan with per-head q/k norms",
}


def valid_tp(model_type: str) -> str:
    """tp sizes up to 16 that the family's default config accepts (empty if refused)."""
    from transformers import AutoConfig

    import hf_tp

    try:
        config = AutoConfig.for_model(model_type)
        adapter = hf_tp.get_adapter(config)
    except (ValueError, KeyError):
        return "(its default config does not build)"
    ok = []
    for tp in range(1, 17):
        try:
            adapter.validate(config, tp)
        except ValueError:
            continue
        ok.append(str(tp))
    return ", ".join(ok)


TINY = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=301)


def plan_less_section() -> str:
    """The families transformers gives no tp plan: those whose plan hf_tp reads from the modules
    (parity at tp=2, three AdamW steps) and the decoders it refuses, with the reason."""
    from transformers import AutoConfig

    import hf_tp
    from hf_tp.adapters.census import plan_less_causal_lm_types
    from hf_tp.adapters.support import GENERIC, READ_REFUSED
    from tests.family_grid import run_family

    rows, held = [], 0
    read = sorted(set(GENERIC) & set(plan_less_causal_lm_types()))
    for mt in read:
        result = run_family(mt, steps=3)
        held += result.status == "parity"
        rows.append(f"| `{mt}` | read from its modules: {result.status} | {valid_tp(mt)} | {GENERIC[mt]} |")
    for mt in sorted(READ_REFUSED):
        tiny = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=301) if mt == "gpt2" else TINY
        try:
            hf_tp.get_adapter(AutoConfig.for_model(mt, **tiny))
            rows.append(f"| `{mt}` | placed (update support.READ_REFUSED) | | |")
        except ValueError as exc:
            rows.append(f"| `{mt}` | refused | | {str(exc).split(': ', 1)[-1].split('; register')[0]} |")
    return f"""

## Families transformers gives no tp plan

Their configs carry no `base_model_tp_plan`. hf_tp reads the projections' split from the modules and
their forwards (`hf_tp/adapters/inspect_plan.py`): in each module holding a decoder layer's
`nn.Linear`s, the one called last into the hidden size is row-parallel, the others column-parallel;
attention when its q / k / v widths are heads x head_dim and kv heads x head_dim, its own head counts
(`num_heads`, `embed_dim`) set to the rank's. **{held} of {len(read)} hold parity** at tp=2 under the
checks above (three AdamW steps); the decoders it refuses name what is missing (q, k and v fused in one projection whose
interleaving the module does not show, ALiBi slopes built for every head, cross-attention).

| model_type | status | valid tp | what is special / why refused |
|---|---|---|---|
""" + "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "architectures.md"))
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from hf_tp.adapters.census import tensor_parallel_causal_lm_types
    from hf_tp.adapters.families import PLAN_OVERRIDES
    from hf_tp.adapters.registry import registered_model_types
    from hf_tp.adapters.support import GENERIC, MOE, REFUSED
    from tests.family_grid import run_family

    dense = sorted(mt for mt, moe in tensor_parallel_causal_lm_types().items() if not moe)
    rows, held = [], 0
    for mt in dense:
        t0 = time.perf_counter()
        result = run_family(mt)
        took = time.perf_counter() - t0
        if result.status == "parity":
            held += 1
            kind = "hand-written" if mt in registered_model_types() else "generic"
            if mt in PLAN_OVERRIDES and not any(".*." in k for k in CONFIG_MAPPING[mt].base_model_tp_plan):
                kind = "hf_tp's layer plan"  # transformers' plan names only the embedding
            note = HAND_WRITTEN.get(mt) or GENERIC.get(mt, "")
            rows.append(f"| `{mt}` | {kind}: parity | {valid_tp(mt)} | {note} |")
        else:
            reason = REFUSED.get(mt) or result.reason.split(": ", 1)[-1].split("; register")[0]
            rows.append(f"| `{mt}` | refused | | {reason} |")
        print(f"{mt:22s} {result.status:8s} {took:5.1f}s", file=sys.stderr, flush=True)

    mixtures = sorted(mt for mt, moe in tensor_parallel_causal_lm_types().items() if moe)
    moe_rows, moe_held = [], 0
    for mt in mixtures:
        t0 = time.perf_counter()
        result = run_family(mt)
        if result.status == "parity":
            moe_held += 1
            own = mt in PLAN_OVERRIDES and not any(".*." in k for k in CONFIG_MAPPING[mt].base_model_tp_plan)
            kind = "hf_tp's layer plan" if own else "generic"
            moe_rows.append(f"| `{mt}` | {kind}: parity | {valid_tp(mt)} | {MOE.get(mt) or GENERIC.get(mt, '')} |")
        else:
            reason = REFUSED.get(mt) or result.reason.split(": ", 1)[-1].split("; register")[0]
            moe_rows.append(f"| `{mt}` | refused | | {reason} |")
        print(f"{mt:22s} {result.status:8s} {time.perf_counter() - t0:5.1f}s", file=sys.stderr, flush=True)
    # MoE families transformers has no tp plan for, whose plan hf_tp's family table writes (GPT-OSS)
    own_plan = sorted(set(MOE) - set(mixtures))
    for mt in own_plan:
        result = run_family(mt)
        status = "hf_tp's plan: parity" if result.status == "parity" else f"hf_tp's plan: {result.status}"
        moe_rows.append(f"| `{mt}` | {status} | {valid_tp(mt)} | {MOE[mt]} |")

    own_plan_text = (
        f" Below the families of transformers' plans, {', '.join(own_plan)}: transformers has no tp plan for it, "
        "hf_tp writes one (`hf_tp/adapters/families.py`) and holds it to the same checks."
        if own_plan
        else ""
    )
    text = (
        f"""# Architectures

Generated by `scripts/family_grid.py` from the family grid (the runs of
`tests/unit/test_family_grid.py`) on transformers {transformers.__version__}, torch {torch.__version__}.
Every dense causal-LM family that transformers can tensor-parallelize (its config has a
`base_model_tp_plan`): **{held} of {len(dense)} hold parity** with plain single-process HF at tp=2
(logits, loss and every gradient of a tiny random model of the family's own config class, float64,
a right-padded row; the weights after an AdamW step; `model.generate` greedy tokens with left
padding), and the others are refused by `hf_tp.parallelize` with the reason below. tp=4 with KV
heads replicated is checked for granite, exaone4, granite_swa and lfm3.

- **hand-written**: a registered adapter (a plan written in `hf_tp/adapters/families.py`).
- **hf_tp's layer plan**: transformers' plan shards only the embedding (every decoder layer whole);
  the family's entry in `hf_tp/adapters/families.py` names the projections, the generic
  derivation does the rest.
- **generic**: the plan derived from the model by `hf_tp/adapters/generic.py` (transformers'
  `base_model_tp_plan` for the projections; the model's modules and forward sources for the SP
  layout, how blocks are called, and whether the loss may be fused with the lm_head).
- **valid tp**: the tp sizes up to 16 that the family's default (published) shape accepts. KV
  heads are replicated when tp exceeds them (except OLMo 2/3, whose k norm spans all KV heads).

Dropout must be 0 for parity (as in every fine-tuning config these families publish, but
Seed-OSS's default residual dropout is 0.1). Mixture-of-experts families are in the second table.

| model_type | status | valid tp | what is special / why refused |
|---|---|---|---|
"""
        + "\n".join(rows)
        + plan_less_section()
        + f"""

## Mixture-of-experts families

**{moe_held} of {len(mixtures)} hold parity** at tp=2 under the same checks, trained with the router's
load-balancing loss in the loss (`output_router_logits=True`, weight 0.5 so that a wrong router
gradient shows; 4 experts, 2 per token: with one per token and renormalised weights, the router's
gradient is zero in exact arithmetic, and AdamW's first step turns its round-off, which transformers'
fp32 routers put near 1e-10, into an update of about lr that no two summation orders share; the
gradients themselves still match). Every MoE block runs as one expert-tensor-parallel region
(`hf_tp/moe/expert_styles.py`): each rank keeps its slice of every expert's intermediate dim (gate and
up halves alike), routers and gates are replicated with their gradients summed over tp, shared
experts are split like a dense MLP, and the block's input and output cost one all-gather and one
reduce-scatter, as a dense MLP's. DeepSeek-style latent attention runs whole on every rank. Expert
parallelism (`--ep`, [moe.md](moe.md)) holds the same parity for every family marked parity here, at ep=2
(`test_moe_family_ep2`; tp2 x ep2 on Qwen3-MoE, Mixtral, Qwen2-MoE, Ernie and GPT-OSS, routing that leaves
experts empty on Qwen3-MoE, Qwen2-MoE and OLMoE, in `tests/unit/test_expert_parallel.py` and
`test_moe_grid.py`; and through the training loop in `tests/e2e/`).{own_plan_text}

| model_type | status | valid tp | what is special / why refused |
|---|---|---|---|
"""
        + "\n".join(moe_rows)
        + "\n"
    )
    Path(args.out).write_text(text)
    print(
        f"wrote {args.out}: {held} of {len(dense)} dense and {moe_held} of {len(mixtures)} MoE families hold parity",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
