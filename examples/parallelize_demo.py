"""hf_tp.parallelize in ~20 lines: train 3 AdamW steps with TP+SP+loss_parallel and compare every
step's loss with plain single-process HF on the same weights and batch.

    torchrun --standalone --nproc_per_node=2 examples/parallelize_demo.py [--model ID_OR_DIR]
"""

import argparse
import contextlib
import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

import hf_tp

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="Hub id or local dir (default: a tiny random Qwen2)")
args = parser.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)  # same seed on every rank: same tiny model and batch everywhere
if args.model:
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
else:
    config = Qwen2Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    ref = AutoModelForCausalLM.from_config(config)
model = hf_tp.parallelize(copy.deepcopy(ref), hf_tp.build_mesh(tp=dist.get_world_size()))
ids = torch.randint(0, ref.config.vocab_size, (2, 15))
curves = {}
for name, m, ctx in [("hf", ref, contextlib.nullcontext), ("hf_tp", model, hf_tp.loss_parallel)]:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    curves[name] = []
    for _ in range(3):
        with ctx():  # forward and backward both inside loss_parallel
            loss = m(ids, labels=ids, use_cache=False).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        curves[name].append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
worst = max(abs(a - b) / abs(b) for a, b in zip(curves["hf_tp"], curves["hf"], strict=True))
if dist.get_rank() == 0:
    for step, (a, b) in enumerate(zip(curves["hf_tp"], curves["hf"], strict=True)):
        print(f"step {step}: hf_tp loss {a:.6f}  plain HF loss {b:.6f}")
    print(f"tp={dist.get_world_size()}: max relative loss difference {worst:.2e}")
hf_tp.shutdown(exit_code=0 if worst < 1e-5 else 1)  # leave together, then exit (see its docstring)
