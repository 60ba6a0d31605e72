"""LoRA parity: a peft LoRA model of a family trained with hf_tp against the same peft model in
one process (logits, loss, every LoRA gradient, the LoRA weights after AdamW; the frozen base
unchanged bit for bit). Used by tests/unit/test_lora.py over the hand-written families and the
family grid.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import hf_tp
from hf_tp.adapters import PlanOptions
from hf_tp.styles import ReplicatedKVProjection
from tests.helpers import batch, run_threaded
from tests.parity import assert_parity, train_steps


def plan_targets(model: torch.nn.Module, tp: int) -> list[str]:
    """Paths of the linear projections the family's plan splits column- or row-wise at ``tp``:
    every projection hf_tp gives a LoRA rule (``all-linear`` minus whole-run regions)."""
    config = model.config
    adapter = hf_tp.get_adapter(config)
    opts = PlanOptions(kv_replicas=adapter.kv_replicas(config, tp))
    styles = adapter.layer_plan(opts)
    paths = []
    for i, layer in enumerate(model.get_submodule(adapter.layers_path)):
        for path, style in styles.items():
            ok = isinstance(style, ColwiseParallel | RowwiseParallel) and not isinstance(style, ReplicatedKVProjection)
            if ok and type(getattr_path(layer, path)) is torch.nn.Linear:
                paths.append(f"{adapter.layers_path}.{i}.{path}")
    return sorted(paths)


def attention_targets(model: torch.nn.Module) -> list[str]:
    """Paths of every ``nn.Linear`` inside the decoder layers' attention modules (DeepSeek's MLA
    projections: a whole-run region under tp, its LoRA factors whole on every tp rank)."""
    return sorted(n for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".self_attn." in n)


def getattr_path(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def lora(model: torch.nn.Module, targets: list[str] | str = "all-linear", dropout: float = 0.0, r: int = 4):
    """A peft LoRA model with random non-zero adapters (draws from the CPU RNG: main thread)."""
    torch.manual_seed(5)  # every reference LoRA gradient resolved in fp32 (see tests.parity)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=dropout, init_lora_weights=False)
    return get_peft_model(model, config)


def run_lora(
    peft_model: torch.nn.Module,
    tp: int = 2,
    dp: int = 1,
    steps: int = 1,
    b: int = 2,
    micro: int = 1,
    sp: bool = True,
    ep: int = 1,
) -> dict[str, int]:
    """Parity of ``peft_model`` parallelized at (tp, dp) (``sp``: sequence and loss parallel)
    against itself in one process; returns counts of what was checked (LoRA tensors, frozen
    tensors)."""
    vocab = peft_model.config.vocab_size
    data = batch(vocab, b=b, s=13, pad="right" if dp == 1 else None)
    want = train_steps(copy.deepcopy(peft_model), data, steps=steps)
    candidates = [copy.deepcopy(peft_model) for _ in range(tp * dp)]
    lora_names = sorted(n for n in want.start if ".lora_" in n)
    assert lora_names and set(want.grads) == set(lora_names), sorted(set(want.grads) ^ set(lora_names))

    def rank_fn(rank: int) -> None:
        model = candidates[rank]
        mesh = hf_tp.build_mesh(tp=tp, dp=dp, device_type="cpu")
        assert hf_tp.parallelize(model, mesh, sequence_parallel=sp, loss_parallel=sp, ep=ep) is model
        rows = slice(None)
        if dp > 1:
            per = b // dp
            rows = slice(mesh.get_local_rank("dp") * per, (mesh.get_local_rank("dp") + 1) * per)
        local = {k: v[rows] for k, v in data.items()}
        dp_group = mesh["dp"].get_group() if dp > 1 else None
        ctx = hf_tp.loss_parallel if sp else contextlib.nullcontext
        got = train_steps(model, local, steps=steps, ctx=ctx, dp_group=dp_group, micro=micro)
        assert_parity(got, want, rows)
        for name, w in want.start.items():
            if name not in want.grads:  # frozen: bit for bit, and no gradient
                assert torch.equal(got.params[name], w), f"frozen {name} changed"

    run_threaded(tp * dp, rank_fn)
    return {"lora": len(lora_names), "frozen": len(want.start) - len(lora_names)}


# The MoE set at tp2, tp2 x dp2 x ep2 and tp1 x dp2 x ep2: peft's all-linear (attention, routers
# and the fused experts through target_parameters; DeepSeek-V3's MLA attention is a whole-run
# region under tp).
MOE_SET = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3")
MOE_MESHES = ((2, 1, 1), (2, 2, 2), (1, 2, 2))


def main_moe() -> None:
    """The MoE set over :data:`MOE_MESHES` (the CI tests run Qwen3-MoE and Mixtral at tp2 and ep2)."""
    from tests.family_grid import grid_config, grid_model

    for model_type in MOE_SET:
        for tp, dp, ep in MOE_MESHES:
            model = grid_model(grid_config(model_type, vocab_size=300))  # (the threaded full_tensor of an
            # uneven vocab shard under FSDP2's strided placement sometimes races: an even vocab here)
            counts = run_lora(lora(model), tp=tp, dp=dp, ep=ep, b=4, steps=2)
            print(model_type, f"tp{tp} dp{dp} ep{ep}", counts, flush=True)


def main() -> None:
    """Every supported dense family of the installed transformers (the CI test runs a sample)."""
    from hf_tp.adapters.support import REFUSED
    from tests.family_grid import grid_config, grid_model
    from tests.unit.test_family_grid import DENSE

    for model_type in [m for m in DENSE if m not in REFUSED]:
        config = grid_config(model_type)
        try:
            hf_tp.get_adapter(config).validate(config, 2)
        except ValueError:
            continue
        model = grid_model(config)
        print(model_type, run_lora(lora(model, plan_targets(model, 2))), flush=True)


if __name__ == "__main__":
    import sys

    main_moe() if "--moe" in sys.argv[1:] else main()
