"""`hf-tp train --lora-r` end to end: one tp2 x dp2 launch against plain single-process peft on the
same batches (loss and grad-norm curves), checkpoints of the trainable tensors, resume."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.e2e.test_train_cli import COMMON, STEPS, hf_tp_train, metrics, setup  # noqa: F401
from tests.reference_loop import reference_run

pytest.importorskip("peft")
pytestmark = pytest.mark.e2e
LORA = ["--lora-r", "4", "--lora-alpha", "16", "--lora-target-modules", "all-linear"]


def _peft(model):
    """Plain peft with hf-tp's initial adapters (peft's default init from the run's seed)."""
    from peft import LoraConfig, get_peft_model

    from hf_tp.lora.peft_models import lora_init_state

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    missing, unexpected = model.load_state_dict(lora_init_state(model, seed=0), strict=False)
    assert not unexpected and all(".lora_" not in k for k in missing)
    return peft_model


def test_lora_tp2_dp2_gives_plain_peft_loss_curve(setup, tmp_path) -> None:  # noqa: F811
    model_dir, data = setup
    out = tmp_path / "run"
    flags = ["--tp", "2", "--dp", "2", "--batch-size", "2", "--save-every", "3", *LORA]
    proc = hf_tp_train("--model", str(model_dir), "--dataset", str(data), "--output-dir", str(out), *COMMON, *flags)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(out)
    want_loss, want_norm, _ = reference_run(
        str(model_dir), str(data), seq_len=15, global_batch=4, steps=STEPS, lr=3e-3, warmup_steps=2, wrap=_peft
    )
    assert want_loss[-1] < want_loss[0]
    for step, (r, w, n) in enumerate(zip(rows, want_loss, want_norm, strict=True)):
        assert abs(r["loss"] - w) <= 1e-5 * abs(w), f"step {step + 1}: loss {r['loss']} vs plain peft {w}"
        assert abs(r["grad_norm"] - n) <= 1e-4 * abs(n), f"step {step + 1}: grad norm {r['grad_norm']} vs {n}"
    # The checkpoints hold the LoRA factors and their optimizer state, not the frozen base.
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(out / "checkpoints" / "step-3")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:3]

    # Resume from step 3 on another mesh (tp1 x dp2): the same curve to the end.
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step-{STEPS}")
    flags = ["--tp", "1", "--dp", "2", "--batch-size", "2", "--resume", "--export-on-finish", *LORA]
    proc = hf_tp_train("--model", str(model_dir), "--dataset", str(data), "--output-dir", str(resumed), *COMMON, *flags)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = [r["loss"] for r in metrics(resumed)]
    assert len(got) == STEPS and "resumed from" in proc.stdout
    for step, (g, w) in enumerate(zip(got, want_loss, strict=True)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step + 1}: resumed loss {g} vs plain peft {w}"

    # The export is a peft adapter folder: plain peft loads it on the base model with the trained factors.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_tp.checkpoint.lora_export import read_lora_tensors

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(resumed / "export"))
    state = loaded.state_dict()
    trained = read_lora_tensors(resumed / "checkpoints" / f"step-{STEPS}")
    assert len(trained) == 2 * 7 * 2
    for key, t in trained.items():
        assert torch.equal(state[f"base_model.model.{key}"], t), key

    # --merge: full weights (base from the model folder + alpha/r * B @ A) that transformers loads,
    # giving the adapter model's logits.
    from hf_tp.checkpoint.hf_folder import export_checkpoint

    merged_dir = export_checkpoint(resumed, tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    ids = torch.randint(3, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits = loaded.eval()(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want_logits, rtol=1e-5, atol=1e-5)
        base_logits = AutoModelForCausalLM.from_pretrained(model_dir).eval()(input_ids=ids).logits
    assert (base_logits - want_logits).abs().max() > 1e-4  # the adapters changed the model
