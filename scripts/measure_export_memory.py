"""Peak host memory of ``hf-tp export``: the streaming writer against the whole-model path it replaced.

    python scripts/measure_export_memory.py                 # a Qwen2-0.5B-shaped checkpoint (494M params)
    python scripts/measure_export_memory.py --layers 4      # a smaller one

Builds a random Qwen2-0.5B-shaped model (tied embedding, vocab 151,936), saves it as an hf_tp
checkpoint (DCP ``{"model": ...}``, model_files, trainer state with a bf16 base), then exports it
in a child process per row and reports the child's peak RSS above its RSS after imports, the
time, the files and tensors written. "whole model" is the path ``hf-tp export`` took before it
streamed (fp32 model on the CPU, ``dcp.load``, cast, ``save_pretrained``), kept here only to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time, warnings
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM
from hf_tp.checkpoint.hf_folder import export_checkpoint

def rss(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field)) * 1024

ckpt, out, mode, shard = sys.argv[1:5]
config = AutoConfig.from_pretrained(ckpt + "/model_files")
with torch.device("meta"):  # imports the model's code before the baseline
    AutoModelForCausalLM.from_config(config)
before, start = rss("VmRSS:"), time.perf_counter()
if mode == "stream":
    export_checkpoint(ckpt, out, max_shard_size=shard)
else:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    state = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=ckpt, no_dist=True)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=shard)
print("RESULT " + json.dumps({"peak": rss("VmHWM:") - before, "seconds": time.perf_counter() - start}))
"""


def build_checkpoint(root: Path, layers: int) -> tuple[Path, int]:
    """A Qwen2-0.5B-shaped hf_tp checkpoint (random weights) under ``root``; returns it and its fp32 bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    base = root / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({**config.to_dict(), "dtype": "bfloat16"}))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    state, made = {}, {}
    for key, tensor in model.state_dict(keep_vars=True).items():  # tied: one tensor under both keys
        if id(tensor) not in made:
            made[id(tensor)] = torch.randn(tensor.shape, generator=gen) * 0.02
        state[key] = made[id(tensor)]
    ckpt = root / "step-1"
    dcp.save({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    config.save_pretrained(ckpt / "model_files")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "base_model": str(base)}))
    (ckpt / "COMPLETE").write_text("step 1\n")
    return ckpt, sum(t.numel() * 4 for t in made.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--shard", default="200MB", help="--max-shard-size of the exports")
    args = parser.parse_args()
    from safetensors import safe_open

    root = Path(tempfile.mkdtemp())
    ckpt, size = build_checkpoint(root, args.layers)
    print(f"checkpoint: {size / 1e9:.2f} GB fp32 ({args.layers} layers), shards of {args.shard}, bf16 base")
    print("| path | peak RSS above imports | time | files | tensors | bytes written |")
    print("|---|---|---|---|---|---|")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for mode, name in (("stream", "streaming (hf-tp export)"), ("whole", "whole model (before)")):
        out = root / f"export-{mode}"
        start = time.perf_counter()
        cmd = [sys.executable, "-c", CHILD, str(ckpt), str(out), mode, args.shard]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        files = sorted(out.glob("*.safetensors"))
        tensors = 0
        for f in files:
            with safe_open(str(f), "pt") as st:
                tensors += len(list(st.keys()))
        written = sum(f.stat().st_size for f in files)
        print(
            f"| {name} | {result['peak'] / 2**20:.0f} MiB | {result['seconds']:.1f} s "
            f"({time.perf_counter() - start:.1f} s with start-up) | {len(files)} | {tensors} | {written / 1e9:.2f} GB |"
        )


if __name__ == "__main__":
    main()
