"""``hf-tp export`` streams: a checkpoint is read a module at a time and written to safetensors
shards as they fill. Its files hold exactly what ``save_pretrained`` writes for the same weights
(packed experts back in HF's layout and split per expert, a tied embedding once), in the base
model's dtype by default; they load with the same logits; host memory follows the shard size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from hf_tp.checkpoint.checkpoint_dirs import MARKER
from hf_tp.checkpoint.hf_folder import export_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def fake_checkpoint(root: Path, config, *, base_dtype: str = "float32") -> tuple[Path, torch.nn.Module]:
    """A step-1 checkpoint as hf_tp writes one (``{"model": ...}`` in DCP, packed gate/up halves
    stored as ``[experts, 2, n, hidden]``), from a random model whose base folder says ``base_dtype``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    base = root / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({**config.to_dict(), "dtype": base_dtype}))
    state = {}
    for key, tensor in model.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            tensor = tensor.view(tensor.shape[0], 2, tensor.shape[1] // 2, *tensor.shape[2:])
        state[key] = tensor
    ckpt = root / "step-1"
    dcp.save({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    model.config.save_pretrained(ckpt / "model_files")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "base_model": str(base)}))
    (ckpt / MARKER).write_text("step 1\n")
    return ckpt, model


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_stream_export_matches_save_pretrained_and_loads(tmp_path: Path) -> None:
    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=301, tie_word_embeddings=True,
    )  # fmt: skip
    ckpt, model = fake_checkpoint(tmp_path, config, base_dtype="bfloat16")
    ids = torch.randint(0, 301, (2, 9), generator=torch.Generator().manual_seed(1))
    want_fp32 = model(ids).logits
    out = export_checkpoint(ckpt, tmp_path / "export", max_shard_size=20_000)
    ref = tmp_path / "ref"
    model.to(torch.bfloat16).save_pretrained(ref)  # what save_pretrained writes for these weights
    got, want = folder_tensors(out), folder_tensors(ref)
    assert "lm_head.weight" not in got and "model.layers.0.mlp.experts.3.up_proj.weight" in got
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = {p.name for p in out.glob("*.safetensors")}
    assert set(index["weight_map"]) == set(got) and set(index["weight_map"].values()) == files and len(files) > 3
    for f in files:  # each shard's tensors fit the size, or it holds one larger tensor alone
        held = [t for t in load_file(out / f).values()]
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held) <= 20_000, f
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert "weights exported in bf16 (the base model's dtype)" in (out / "README.md").read_text()
    logits = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)(ids).logits for p in (out, ref)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    # --dtype overrides the base model's dtype; fp32 gives the checkpoint's numbers and logits exactly.
    out32 = export_checkpoint(ckpt, tmp_path / "fp32", dtype="fp32")
    loaded = AutoModelForCausalLM.from_pretrained(out32, dtype=torch.float32)
    torch.testing.assert_close(loaded(ids).logits, want_fp32, rtol=0, atol=0)
    assert "fp32 (as asked)" in (out32 / "README.md").read_text()


CHILD = """
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from hf_tp.checkpoint.hf_folder import export_checkpoint
def rss(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field)) * 1024
with torch.device("meta"):  # imports the model's code before the baseline: a fixed cost, not the model's size
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1] + "/model_files"))
before = rss("VmRSS:")
peaks = []
for ckpt, out in zip(sys.argv[1::2], sys.argv[2::2]):  # the small model first: its peak holds the fixed costs
    export_checkpoint(ckpt, out, max_shard_size="4MB", dtype="fp32")
    peaks.append(rss("VmHWM:") - before)
print(*peaks)
"""


def llama(layers: int) -> AutoConfig:
    return AutoConfig.for_model(
        "llama", hidden_size=384, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=4096, tie_word_embeddings=True,
    )  # fmt: skip


def test_stream_export_memory_follows_shard_size(tmp_path: Path) -> None:
    """A 2-layer (21 MB fp32) and a 12-layer (91 MB) model exported with 4 MB shards in one process:
    the larger one raises the peak by a small fraction of the 70 MB it adds (the peak is about a
    shard, the largest tensor and fixed costs, none of which grows with depth)."""
    small, _ = fake_checkpoint(tmp_path / "small", llama(2))
    ckpt, model = fake_checkpoint(tmp_path / "big", llama(12))
    size = sum(p.numel() * 4 for p in model.parameters())
    added = size - sum(p.numel() * 4 for p in AutoModelForCausalLM.from_config(llama(2)).parameters())
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = [str(small), str(tmp_path / "small-export"), str(ckpt), str(tmp_path / "export")]
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak_small, peak = (int(x) for x in proc.stdout.split()[-2:])
    mib = 2**20
    print(
        f"model {size / mib:.1f} MiB, export peak growth {peak / mib:.1f} MiB (2-layer model: {peak_small / mib:.1f})"
    )
    assert peak - peak_small < added / 4, (
        f"10 more layers ({added / mib:.1f} MiB) raised the export's peak by {(peak - peak_small) / mib:.1f} MiB"
    )
    assert peak < size / 3, f"the export grew by {peak / mib:.1f} MiB for a {size / mib:.1f} MiB model"
    got = folder_tensors(tmp_path / "export")
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(got) == sorted(want) and len(list((tmp_path / "export").glob("*.safetensors"))) > 10
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
