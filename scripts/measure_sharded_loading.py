"""Peak host memory per rank when loading a model for training: sharded loading vs from_pretrained.

    python scripts/measure_sharded_loading.py                       # a ~430 MB fp32 Llama, one file
    python scripts/measure_sharded_loading.py --max-shard-size 50MB --meshes 1x2,2x2,1x4
    python scripts/measure_sharded_loading.py --moe --max-shard-size 16MB --meshes 1x2,1x4:2,2x2:2

``--moe`` saves a Qwen3-MoE instead, one tensor per expert as Hub MoE checkpoints hold them
(fused into 3-D experts on load); ``TPxDP:EP`` meshes add expert parallelism.

For each tp x dp mesh it starts tp * dp ranks (torchrun, gloo, CPU) that each either (a) build the
model on the meta device, parallelize it (TP, then FSDP2 over dp) and read their shards from the
safetensors files (hf_tp's path), or (b) load the whole model with from_pretrained and then
parallelize it. Each rank reports its peak RSS and peak anonymous memory above its values after
imports; the table shows the maximum over ranks, and the rank's share (its local parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def anon_mib() -> float:
    """Anonymous (non file-backed) resident memory: RSS also counts the safetensors pages that
    are memory-mapped while reading, which the kernel can drop at any time."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


class AnonPeak:
    """Samples RssAnon every 5 ms in a thread; ``peak`` is the highest value seen."""

    def __init__(self) -> None:
        import threading

        self.peak, self._stop = anon_mib(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, anon_mib())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, anon_mib())


def worker(model_dir: str, mode: str, tp: int, dp: int, ep: int = 1) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_tp
    from hf_tp.run.config import TrainConfig
    from hf_tp.run.model import build_parallel_model

    dist.init_process_group("gloo")
    base, anon_base = rss_mib(), anon_mib()
    sampler = AnonPeak()
    mesh = hf_tp.build_mesh(tp=tp, dp=dp, device_type="cpu")
    if mode == "sharded":
        cfg = TrainConfig(model=model_dir, dataset="unused", tp=tp, dp=dp, ep=ep, seq_len=128).resolve()
        model = build_parallel_model(cfg, mesh, torch.device("cpu"))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        hf_tp.parallelize(model, mesh, ep=ep)
    anon_peak = sampler.stop() - anon_base
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()) * 4 / 2**20
    out = [None] * dist.get_world_size()
    dist.all_gather_object(
        out, {"peak_above_base_mib": rss_mib() - base, "anon_peak_mib": anon_peak, "local_params_mib": local}
    )
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out))
    hf_tp.shutdown(exit_code=0)  # leave together, then exit without finalization (see its docstring)


def build_model(
    folder: Path, layers: int, hidden: int, vocab: int, max_shard_size: str, moe: bool = False
) -> tuple[float, int]:
    """A random fp32 Llama (or Qwen3-MoE: 16 experts, top-2) saved to ``folder``; returns its
    size in MiB and its safetensors file count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    sizes = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=16,
                 num_key_value_heads=8, max_position_embeddings=2048)  # fmt: skip
    if moe:
        config = Qwen3MoeConfig(**sizes, intermediate_size=hidden * 2, moe_intermediate_size=hidden // 2,
                                num_experts=16, num_experts_per_tok=2)  # fmt: skip
    else:
        config = LlamaConfig(**sizes, intermediate_size=hidden * 11 // 4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return sum(p.numel() for p in model.parameters()) * 4 / 2**20, len(list(folder.glob("*.safetensors")))


def run_mesh(model_dir: Path, mode: str, tp: int, dp: int, ep: int = 1) -> list[dict]:
    """Every rank's figures for one load on a tp x dp mesh (ep: expert parallelism)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp * dp}"]
    cmd += [__file__, "--worker", str(model_dir), mode, str(tp), str(dp), str(ep)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors file size of the saved model")
    parser.add_argument("--meshes", default="1x1,2x1,4x1", help="tp x dp meshes, comma-separated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE saved one tensor per expert")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp()) / "model"
    size, files = build_model(folder, args.layers, args.hidden, args.vocab, args.max_shard_size, args.moe)
    kind = "Qwen3-MoE, 16 experts" if args.moe else "Llama"
    print(
        f"model: {size:.0f} MiB fp32 {kind} ({args.layers} layers, hidden {args.hidden}) in {files} safetensors files"
    )
    print("| tp x dp (ep) | sharded: peak RSS | sharded: peak anon | from_pretrained: peak RSS | from_pretrained: peak anon "
          "| rank's share |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for mesh in args.meshes.split(","):
        shape, _, ep = mesh.partition(":")
        tp, dp = (int(x) for x in shape.split("x"))
        row = {mode: run_mesh(folder, mode, tp, dp, int(ep or 1)) for mode in ("sharded", "full")}
        peak = {m: max(r["peak_above_base_mib"] for r in v) for m, v in row.items()}
        anon = {m: max(r["anon_peak_mib"] for r in v) for m, v in row.items()}
        print(
            f"| {tp} x {dp} ({ep or 1}) | {peak['sharded']:.0f} | {anon['sharded']:.0f} | {peak['full']:.0f} | "
            f"{anon['full']:.0f} | {max(r['local_params_mib'] for r in row['sharded']):.0f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
