"""Checkpoints end to end: crash (SIGKILL) mid-step and mid-save, resume on other meshes, export,
reload with plain transformers; compared with plain single-process HF training on the same batches."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from hf_tp.checkpoint.dcp import complete_checkpoints, latest_checkpoint
from tests.e2e.test_train_cli import cli_in_process, hf_tp_train, metrics, setup  # noqa: F401 - fixture
from tests.parity import assert_weights_after_adam_close
from tests.reference_loop import reference_losses

pytestmark = pytest.mark.e2e
RUN = ["--seq-len", "15", "--max-steps", "6", "--lr", "3e-3", "--warmup-steps", "2", "--no-tensorboard"]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict())


@pytest.fixture(scope="module")
def crashed_run(setup, tmp_path_factory) -> Path:  # noqa: F811
    """A run crashed mid-save at tp2 x dp2, resumed and crashed again at tp4 x dp1, resumed and
    finished at tp1 x dp2 with --export-on-finish (checkpoints every 2 steps)."""
    model_dir, data = setup
    run = tmp_path_factory.mktemp("crash") / "run"
    flags = ["--model", str(model_dir), "--dataset", str(data), *RUN, "--output-dir", str(run), "--save-every", "2"]
    # 1) tp=2 x dp=2; rank 1 is killed while the step-4 checkpoint is being written.
    os.environ["HF_TP_CRASH"] = "save:4:1"
    try:
        proc = hf_tp_train(*flags, "--tp", "2", "--dp", "2", "--batch-size", "2")
    finally:
        del os.environ["HF_TP_CRASH"]
    assert proc.returncode != 0 and "training failed" in proc.stderr
    assert (run / "checkpoints" / ".tmp-step-4").is_dir()  # half-written, never published
    assert [p.name for p in complete_checkpoints(run)] == ["step-2"]

    # 2) resume at tp=4 x dp=1 from step 2; rank 3 is killed at the start of step 5.
    os.environ["HF_TP_CRASH"] = "train:5:3"
    try:
        proc = hf_tp_train(*flags, "--tp", "4", "--dp", "1", "--batch-size", "4", "--resume")
    finally:
        del os.environ["HF_TP_CRASH"]
    assert proc.returncode != 0
    assert "resumed from" in proc.stdout and "step-2" in proc.stdout
    assert latest_checkpoint(run).name == "step-4"

    # 3) resume at tp=1 x dp=2 from step 4 and finish, exporting at the end.
    proc = hf_tp_train(*flags, "--tp", "1", "--dp", "2", "--batch-size", "2", "--resume", "--export-on-finish")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_crash_resume_on_other_meshes_then_export(setup, crashed_run) -> None:  # noqa: F811
    """The crashed and resumed run gives plain single-process HF's loss curve, and its export
    loads with plain transformers holding plain HF's weights after the same 6 AdamW steps."""
    model_dir, data = setup
    run = crashed_run
    want_weights: dict[str, torch.Tensor] = {}
    want, _ = reference_losses(
        str(model_dir),
        str(data),
        seq_len=15,
        global_batch=4,
        steps=6,
        lr=3e-3,
        warmup_steps=2,
        weights_out=want_weights,
    )
    got = [r["loss"] for r in metrics(run)]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step + 1}: resumed loss {g} vs plain HF {w}"
    assert_weights_after_adam_close(weights(run / "export"), want_weights, weights(model_dir))
    files = {p.name for p in (run / "export").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= files


def test_export_cli_errors_and_push_without_network(setup, crashed_run, tmp_path, capsys, monkeypatch) -> None:  # noqa: F811
    model_dir, data = setup
    out = tmp_path / "run"
    shutil.copytree(crashed_run, out)
    shutil.rmtree(out / "export")
    # Resuming a finished run takes no step; --export-on-finish still exports its newest checkpoint.
    flags = ["--model", str(model_dir), "--dataset", str(data), *RUN, "--output-dir", str(out), "--save-every", "2"]
    proc = hf_tp_train(*flags, "--tp", "1", "--dp", "1", "--batch-size", "4", "--resume", "--export-on-finish")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to train" in proc.stdout and "exported step-6" in proc.stdout
    assert (out / "export" / "model.safetensors").is_file()
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a push never reaches the network

    def export(*args: str) -> subprocess.CompletedProcess:
        return cli_in_process(capsys, "export", *args)

    bad = export(str(tmp_path / "nothing"), str(tmp_path / "x"))
    assert bad.returncode == 2 and "nothing does not exist" in bad.stderr
    (tmp_path / "no-ckpt").mkdir()
    (tmp_path / "no-ckpt" / "metrics.jsonl").write_text("{}\n")
    bad = export(str(tmp_path / "no-ckpt"), str(tmp_path / "x"))
    assert bad.returncode == 2 and "saved no checkpoint; train with --save-every N" in bad.stderr
    dest = tmp_path / "hf"
    pushed = export(str(out), str(dest), "--push-to-hub", "someone/tiny")
    assert pushed.returncode == 1
    assert "push to the Hub repo 'someone/tiny' failed" in pushed.stderr and f"kept at {dest}" in pushed.stderr
    assert (dest / "model.safetensors").is_file()
    again = export(str(out), str(dest))
    assert again.returncode == 2 and "is not empty" in again.stderr
    # The export holds exactly the checkpoint's tensors (read back independently with torch's converter).
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(latest_checkpoint(out)), str(tmp_path / "ckpt.pt"))
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    exported = weights(dest)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    card = (dest / "README.md").read_text()
    assert "6 optimizer steps" in card
    # The card names the base model (a local dir: by its name), never a path of this machine.
    assert "# local model `qwen2`, trained with hf_tp" in card and str(tmp_path) not in card
    # Ordinary permissions: what mkdir and open make under the umask (755 and 644 with 022).
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE(f.stat().st_mode) for f in dest.iterdir()} == {0o666 & ~umask}
    assert json.loads((dest / "config.json").read_text())["model_type"] == "qwen2"
