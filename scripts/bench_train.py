"""Benchmark ``hf-tp train`` against the plain HF ``Trainer`` on one device (tp=1, dp=1).

Same random-weight model, sequence length, global batch, optimizer (AdamW), schedule and data for
both; reports tokens/s per device, MFU (PaLM's formula, as torchtitan reports it) and peak memory.

    python scripts/bench_train.py                       # GPU: Qwen2-0.5B shapes, seq 2048 and 4096, bf16
    python scripts/bench_train.py --smoke               # CPU: a tiny model, a few steps (CI runs this)
    python scripts/bench_train.py --out docs/bench.json # also write the rows as JSON

Each run is a separate process (clean peak-memory counters, no leftover process group). Step
times are the median over the steps after ``--warmup`` (compilation and allocator warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_model_dir(shape: str, root: Path) -> Path:
    """Random weights of a real shape (or a tiny one), saved with the embedded default tokenizer
    (its ids are valid in any larger vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from hf_tp.core.model_source import bundled_config
    from hf_tp.demo.assets import ensure_default_assets

    assets = ensure_default_assets(root / "assets")
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    if shape == "tiny":
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
    else:
        config = bundled_config(shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = root / shape
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_hf_tp(args, model_dir: Path, data: Path, seq: int, ac: bool, compile_: bool, work: Path) -> dict:
    out = work / f"hf_tp-{seq}-{int(ac)}-{int(compile_)}"
    cmd = [
        sys.executable,
        "-m",
        "hf_tp.cli.main",
        "train",
        "--model",
        str(model_dir),
        "--dataset",
        str(data),
        "--tp",
        "1",
        "--dp",
        "1",
        "--seq-len",
        str(seq),
        "--batch-size",
        str(args.batch_size),
        "--max-steps",
        str(args.steps),
        "--warmup-steps",
        "0",
        "--lr",
        "3e-4",
        "--output-dir",
        str(out),
        "--no-tensorboard",
        "--dtype",
        args.dtype,
        "--device",
        args.device,
    ]
    cmd += ["--activation-checkpointing"] if ac else []
    cmd += ["--compile"] if compile_ else []
    cmd += ["--profile-steps", f"{args.steps - 1}-{args.steps}"] if args.profile_dir else []
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hf-tp train failed:\n{proc.stderr[-3000:]}")
    if args.profile_dir:
        keep_profile(out / "profile" / "rank0.ops.txt", args.profile_dir, f"hf_tp-{seq}-{variant_name(ac, compile_)}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][
        args.warmup : timed_end(args)
    ]
    mem = max(r.get("peak_mem_mib", r.get("peak_rss_mib", 0)) for r in rows)
    mfu = [r["mfu"] for r in rows if "mfu" in r]
    return {
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in rows),
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_mem_mib": mem,
    }


def timed_end(args) -> int:
    """Steps after the warm-up are timed, except the two profiled ones (the profiler slows them)."""
    return args.steps - 2 if args.profile_dir else args.steps


def variant_name(ac: bool, compile_: bool) -> str:
    return "+".join(["ac"] * ac + ["compile"] * compile_) or "plain"


def keep_profile(ops: Path, dest: str, name: str) -> None:
    Path(dest).mkdir(parents=True, exist_ok=True)
    (Path(dest) / f"{name}.ops.txt").write_text(ops.read_text())


def trainer_worker(args) -> None:
    """One HF Trainer run (in its own process); prints a JSON line."""
    import resource

    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from hf_tp.data import load_text_dataset, tokenize_dataset
    from hf_tp.gpus import model_flops_per_token
    from hf_tp.train.metrics import peak_flops
    from hf_tp.train.profile import StepProfiler

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    data = tokenize_dataset(load_text_dataset(args.data), tok, seq_len=args.seq)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    times: list[float] = []
    cuda = args.device == "cuda"
    work = Path(args.work)
    steps = (args.steps - 1, args.steps) if args.profile_dir else None
    profiler = StepProfiler(steps, work / "profile", 0, torch.device("cuda" if cuda else "cpu"))

    class Timer(TrainerCallback):
        """Step time = the interval between two step ends, as hf-tp train measures it: data
        loading, logging and the optimizer are inside it (the Trainer loads a batch before its
        on_step_begin, so timing begin -> end would leave that out)."""

        t_end: float | None = None

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self.t_end is not None:
                times.append(now - self.t_end)
            self.t_end = now
            profiler.step()

    targs = TrainingArguments(
        output_dir=args.work,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=3e-4,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.1,
        adam_beta2=0.95,
        bf16=cuda and args.dtype == "bf16",
        use_cpu=not cuda,
        gradient_checkpointing=args.ac,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        torch_compile=args.compile,
        report_to=[],
        save_strategy="no",
        logging_steps=10**9,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=[Timer()],
    )
    trainer.train()
    profiler.close()
    if args.profile_dir:
        keep_profile(
            work / "profile" / "rank0.ops.txt",
            args.profile_dir,
            f"trainer-{args.seq}-{variant_name(args.ac, args.compile)}",
        )
    dt = statistics.median(times[max(args.warmup - 1, 0) : timed_end(args) - 1])  # times[i] ends step i+2
    tps = args.batch_size * args.seq / dt
    device = torch.device("cuda" if cuda else "cpu")
    peak = peak_flops(device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    nparams = sum(p.numel() for p in model.parameters())
    mem = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        "RESULT "
        + json.dumps(
            {
                "tokens_per_sec": tps,
                "peak_mem_mib": mem / 2**20,
                "mfu": model_flops_per_token(model.config, nparams, args.seq) * tps / peak if peak else None,
            }
        )
    )


def run_trainer(args, model_dir: Path, data: Path, seq: int, ac: bool, compile_: bool, work: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--trainer-worker",
        "--model-dir",
        str(model_dir),
        "--data",
        str(data),
        "--seq",
        str(seq),
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--work",
        str(work / f"trainer-{seq}-{variant_name(ac, compile_)}"),
    ]
    cmd += ["--profile-dir", args.profile_dir] if args.profile_dir else []
    cmd += ["--ac"] if ac else []
    cmd += ["--compile"] if compile_ else []
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"Trainer run failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few steps")
    p.add_argument("--shape", default="qwen2-0.5b")
    p.add_argument("--seq-lens", default="2048,4096")
    p.add_argument("--tokens-per-step", type=int, default=16384, help="batch = this / seq (at least 1)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="plain,ac,compile,ac+compile")
    p.add_argument("--out")
    p.add_argument("--skip-trainer", action="store_true", help="time hf-tp train only")
    p.add_argument("--skip-hf-tp", action="store_true", help="time the Trainer only")
    p.add_argument("--profile-dir", help="profile two steps after the warm-up of every run; op tables land here")
    # worker mode
    p.add_argument("--trainer-worker", action="store_true")
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-dir")
    p.add_argument("--data")
    p.add_argument("--seq", type=int)
    p.add_argument("--work")
    p.add_argument("--ac", action="store_true")
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    if args.trainer_worker:
        return trainer_worker(args)
    if args.smoke:
        args.shape, args.seq_lens, args.steps, args.warmup, args.tokens_per_step = "tiny", "64", 4, 1, 64
        args.dtype, args.device = "fp32", "cpu"
        args.variants = "plain" if args.variants == p.get_default("variants") else args.variants
    os.environ.setdefault("OMP_NUM_THREADS", "1" if args.device == "cpu" else os.environ.get("OMP_NUM_THREADS", "8"))
    work = Path(tempfile.mkdtemp(prefix="hf_tp_bench-"))
    model_dir = make_model_dir(args.shape, work)
    data = work / "assets" / "default-tiny-llama-v1" / "corpus.txt"
    rows = []
    print(
        "| model | seq | batch | variant | hf_tp tok/s | Trainer tok/s | speed-up | hf_tp MFU | Trainer MFU | hf_tp peak MiB | Trainer peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for seq in (int(s) for s in args.seq_lens.split(",")):
        args.batch_size = max(1, args.tokens_per_step // seq)
        for variant in args.variants.split(","):
            ac, compile_ = "ac" in variant, "compile" in variant
            na = {"tokens_per_sec": float("nan"), "mfu": None, "peak_mem_mib": float("nan")}
            ours = na if args.skip_hf_tp else run_hf_tp(args, model_dir, data, seq, ac, compile_, work)
            theirs = na if args.skip_trainer else run_trainer(args, model_dir, data, seq, ac, compile_, work)
            row = {
                "model": args.shape,
                "seq": seq,
                "batch": args.batch_size,
                "variant": variant,
                "hf_tp": ours,
                "trainer": theirs,
            }
            rows.append(row)

            def pct(x):
                return f"{100 * x:.1f}%" if x is not None else "n/a"

            print(
                f"| {args.shape} | {seq} | {args.batch_size} | {variant} | {ours['tokens_per_sec']:.0f} | {theirs['tokens_per_sec']:.0f} | "
                f"{ours['tokens_per_sec'] / theirs['tokens_per_sec']:.2f}x | {pct(ours['mfu'])} | {pct(theirs['mfu'])} | "
                f"{ours['peak_mem_mib']:.0f} | {theirs['peak_mem_mib']:.0f} |",
                flush=True,
            )
            if args.out:  # after every row, so a run cut short keeps what it measured
                Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
