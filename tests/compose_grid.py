"""The new blocks (issue 41) composed with context parallelism, LoRA and activation checkpointing:
a tiny random model of a family trained at tp2 x cp2, tp2 with peft LoRA, or tp2 with activation
checkpointing, on threads of one process, against plain HF (LoRA: against the same plain peft
model) on the same rows: logits, loss, every trainable gradient, the weights after AdamW.

Used by tests/unit/test_new_blocks_compose.py (a sample, in one shared threaded world) and
``python -m tests.compose_grid [FAMILY...]`` (every family of :data:`FAMILIES` in every mode;
about a minute).
"""

from __future__ import annotations

import copy
import sys

import torch

import hf_tp
from hf_tp.context.token_share import TokenShare
from tests.cp_grid import SEQ, cp_batch
from tests.family_grid import exact_model, grid_config, grid_model, is_moe
from tests.helpers import batch, run_threaded
from tests.parity import Trace, assert_parity, train_steps

# A hyper-connection family of each kind, the per-layer mixer families, per-layer embeddings, the
# decoder away from its prefix, and new MoE layouts (a packed shared expert, 3-D shared experts)
FAMILIES: dict[str, dict] = {
    "deepseek_v4": {},
    "qwen4_exp_text": {},
    "hy_v4": {},
    "nemotron_h": {},
    "minimax": {},
    "gemma4_text": {},
    "gemma4_text+moe": dict(enable_moe_block=True, top_k_experts=2),  # experts the layer calls itself
    "llama4_text": {},
    "minimax_m3_vl_text": {},
    "inkling_text": {},
    "dots1": {},
}
MODES = ("cp", "lora", "ac")
# cp refuses a sparse-attention indexer (it selects keys from the whole mask) and DeepSeek-V4's
# compressors (they pool every compress_rate tokens of the whole row before attention): under cp,
# DeepSeek-V4's layers are all of one kind, so the refusal names its compressor
CP_LAYER: dict[str, str] = {"deepseek_v4": "heavily_compressed_attention"}
CP_CONFIG: dict[str, dict] = {}


def _reference(name: str, mode: str) -> tuple[torch.nn.Module, dict, Trace]:
    """The plain HF (or peft) model, its rows and its trace (main thread: it draws from the CPU RNG)."""
    config = grid_config(
        name.split("+")[0], **FAMILIES.get(name, {}), **(CP_CONFIG.get(name, {}) if mode == "cp" else {})
    )
    if mode == "cp" and name in CP_LAYER:
        config.layer_types = [CP_LAYER[name]] * config.num_hidden_layers
    if is_moe(config):
        config.output_router_logits = False  # HF's aux loss is per forward (hf_tp.fit reduces it globally)
    model = exact_model(grid_model(config))
    if mode == "lora":
        from tests.lora_grid import attention_targets, lora, plan_targets

        # the projections tp splits, and those of attentions that run whole (latent attention)
        model = lora(model, sorted(set(plan_targets(model, 2)) | set(attention_targets(model))))
    data = cp_batch(config.vocab_size, "packed", b=2) if mode == "cp" else batch(config.vocab_size, b=2, s=13)
    start = copy.deepcopy(model)
    return start, data, train_steps(model, data, steps=2)


def _trainable(trace: Trace, names: set[str], logits: torch.Tensor) -> Trace:
    def keep(d: dict) -> dict:
        return {n: v for n, v in d.items() if n in names}

    return Trace(logits, keep(trace.grads), trace.losses, keep(trace.params), keep(trace.start))


def run_compose(name: str, mode: str) -> str:
    """``"parity"``, or ``"refused: <hf_tp's one line>"`` where parallelize refuses the mode."""
    from hf_tp.verify.compare import stream_mixer_params

    start, data, want = _reference(name, mode)
    cp = 2 if mode == "cp" else 1
    candidates = [copy.deepcopy(start) for _ in range(2 * cp)]
    mixers = stream_mixer_params(start)
    refusals: dict[int, str] = {}

    def rank_fn(rank: int) -> None:
        model = candidates[rank]
        mesh = hf_tp.build_mesh(tp=2, cp=cp, device_type="cpu")
        try:
            hf_tp.parallelize(model, mesh, activation_checkpointing=mode == "ac")
        except ValueError as exc:
            refusals[rank] = str(exc)
            return
        got = train_steps(model, data, steps=2, ctx=hf_tp.loss_parallel)
        logits = want.logits
        if cp > 1:
            logits = logits[:, TokenShare(cp, mesh.get_local_rank("cp")).indices(SEQ)]
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        assert_parity(_trainable(got, names, got.logits), _trainable(want, names, logits), uncapped=mixers)
        for name, w in want.start.items():
            if name not in names:  # frozen (LoRA's base): bit for bit
                assert torch.equal(got.params[name], w), f"frozen {name} changed"

    run_threaded(2 * cp, rank_fn)
    if refusals:
        assert len(set(refusals.values())) == 1 and len(refusals) == 2 * cp, refusals
        return f"refused: {refusals[0]}"
    return "parity"


def main() -> None:
    from hf_tp.compat import family_refusal

    for name in sys.argv[1:] or FAMILIES:
        if refusal := family_refusal(name.split("+")[0]):
            print(f"{name}: skipped ({refusal})", flush=True)
            continue
        for mode in MODES:
            try:
                outcome = run_compose(name, mode)
            except Exception as exc:  # noqa: BLE001 - reported per case
                outcome = "FAILED " + str(exc).splitlines()[-1][:300]
            print(f"{name} {mode}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
