"""Peak host memory per rank when loading a model for training: sharded loading vs from_pretrained.

    python scripts/measure_sharded_loading.py            # builds a ~450 MB fp32 Llama in a temp dir

For tp in 1, 2, 4 it starts tp ranks (torchrun, gloo, CPU) that each either (a) build the model on
the meta device, parallelize it and read their shards from the safetensors (hf_tp's path), or
(b) load the whole model with from_pretrained and then parallelize it. Each rank reports its peak
RSS above its RSS after imports; the table shows the maximum over ranks.
"""

from __future__ import annotations

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


def worker(model_dir: str, mode: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_tp
    from hf_tp.train.config import TrainConfig
    from hf_tp.train.model import build_parallel_model

    dist.init_process_group("gloo")
    base, anon_base = rss_mib(), anon_mib()
    sampler = AnonPeak()
    tp = dist.get_world_size()
    mesh = hf_tp.build_mesh(tp=tp, device_type="cpu")
    if mode == "sharded":
        cfg = TrainConfig(model=model_dir, dataset="unused", tp=tp, dp=1, seq_len=128).resolve()
        model = build_parallel_model(cfg, mesh, torch.device("cpu"))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        hf_tp.parallelize(model, mesh)
    anon_peak = sampler.stop() - anon_base
    local = sum(p.to_local().numel() for p in model.parameters()) * 4 / 2**20
    out = [None] * tp
    dist.all_gather_object(
        out, {"peak_above_base_mib": rss_mib() - base, "anon_peak_mib": anon_peak, "local_params_mib": local}
    )
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out))
    hf_tp.shutdown(exit_code=0)  # leave together, then exit without finalization (see its docstring)


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = Path(tempfile.mkdtemp())
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    size = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    model.save_pretrained(tmp / "model")
    del model
    print(f"model: {size:.0f} MiB fp32 ({config.num_hidden_layers} layers, hidden {config.hidden_size})")
    print(
        "| tp | sharded: peak RSS | sharded: peak anon | from_pretrained: peak RSS | from_pretrained: peak anon | local params |"
    )
    print("|---|---|---|---|---|---|")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for tp in (1, 2, 4):
        row = {}
        for mode in ("sharded", "full"):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={tp}",
                __file__,
                "--worker",
                str(tmp / "model"),
                mode,
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
            row[mode] = json.loads(line[len("RESULT ") :])
        peak = {m: max(r["peak_above_base_mib"] for r in v) for m, v in row.items()}
        anon = {m: max(r["anon_peak_mib"] for r in v) for m, v in row.items()}
        print(
            f"| {tp} | {peak['sharded']:.0f} | {anon['sharded']:.0f} | {peak['full']:.0f} | {anon['full']:.0f} | "
            f"{row['sharded'][0]['local_params_mib']:.0f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
