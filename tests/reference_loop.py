"""Plain single-process HF training on the global batches: the reference for ``hf-tp train``.

No hf_tp model code runs here: the model is a plain ``from_pretrained`` model, the loss is HF's
``labels=`` token mean over the whole global batch, and clipping is torch's own. The data (rows,
labels, position_ids) come from hf_tp.data, as the CLI reads them; image + text conversations
(TRL's ``messages`` + ``images``) are encoded and batched by the checkpoint's processor as there.
"""

from __future__ import annotations

import math

import torch
from transformers import AutoProcessor, AutoTokenizer

from hf_tp.core.model_source import ModelSource
from hf_tp.data import GlobalBatchOrder, PadToMultipleCollator, load_text_dataset, tokenize_dataset
from hf_tp.data.formats.images import ImageBatchCollator, is_image_data
from hf_tp.data.image_data import dataset_dir, encode_image_dataset


def reference_losses(model_dir: str, dataset: str, **kwargs) -> tuple[list[float], list[float]]:
    """Loss and grad-norm curves of :func:`reference_run`."""
    losses, norms, _ = reference_run(model_dir, dataset, **kwargs)
    return losses, norms


def reference_run(
    model_dir: str,
    dataset: str,
    *,
    seq_len: int,
    global_batch: int,
    steps: int,
    lr: float,
    warmup_steps: int,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.1,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    eval_split: float = 0.0,
    eval_steps: tuple[int, ...] = (),
    eval_rows: int | None = None,
    wrap=None,
    weights_out: dict[str, torch.Tensor] | None = None,
) -> tuple[list[float], list[float], dict[int, float]]:
    """Losses, grad norms and, after each step of ``eval_steps``, the loss over the held-out
    ``eval_split`` of the documents (split as hf-tp does: ``train_test_split`` seeded with ``seed``),
    over its first ``eval_rows`` rows (all by default). ``wrap(model)``, if given, returns the model
    to train (a peft LoRA model of it, or the model with its vision tower frozen). ``weights_out``,
    if given, receives the final state dict."""
    raw = load_text_dataset(dataset)
    held_out = None
    if is_image_data(raw.column_names):  # image + text rows: the processor encodes and batches them
        assert not eval_split, "hf-tp train evaluates no image + text data"
        processor = AutoProcessor.from_pretrained(model_dir)
        where = dict(label=f"'{dataset}'", base_dir=dataset_dir(dataset))
        data, _ = encode_image_dataset(raw, processor, seq_len=seq_len, assistant_only=True, **where)
        collate = ImageBatchCollator(processor, base_dir=where["base_dir"])
    else:
        tok = AutoTokenizer.from_pretrained(model_dir)
        if eval_split:
            parts = raw.train_test_split(test_size=eval_split, seed=seed, shuffle=True)
            raw, held_out = parts["train"], tokenize_dataset(parts["test"], tok, seq_len=seq_len, keep_tail=True)
            held_out = held_out.select(range(min(len(held_out), eval_rows or len(held_out))))
        data = tokenize_dataset(raw, tok, seq_len=seq_len)
        collate = PadToMultipleCollator(pad_token_id=tok.pad_token_id or 0)
    model = ModelSource.at(model_dir).load(dtype=torch.float32)  # a multimodal wrapper as its own class
    model = wrap(model) if wrap is not None else model
    model.train()
    plan = GlobalBatchOrder(num_examples=len(data), global_batch=global_batch, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(steps, warmup_steps, min_lr_ratio))
    losses, norms, evals = [], [], {}
    for step in range(steps):
        batch = collate([data[i] for i in plan.step_indices(step)])
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        losses.append(loss.item())
        opt.step()
        sched.step()
        opt.zero_grad()
        if step + 1 in eval_steps:
            model.eval()
            with torch.no_grad():  # one batch of every held-out row: HF's loss is their token mean
                evals[step + 1] = model(**collate(list(held_out)), use_cache=False).loss.item()
            model.train()
    if weights_out is not None:
        weights_out.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, norms, evals


def reference_dpo_run(
    model_dir: str,
    dataset: str,
    *,
    seq_len: int,
    global_batch: int,
    steps: int,
    lr: float,
    warmup_steps: int,
    beta: float = 0.1,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.1,
    max_grad_norm: float = 1.0,
    seed: int = 0,
) -> tuple[list[float], list[float], list[float]]:
    """Plain single-process DPO (the sigmoid loss against a frozen copy of the initial model) on the
    global batches of preference pairs: losses, grad norms and the mean reward margins. Each row's
    log-prob is HF's logits' log_softmax at its labels (shifted), summed; the pairs are tokenized
    and batched by hf_tp.data (chosen rows, then rejected rows), as the CLI reads them."""
    from hf_tp.data.pairs import PairCollator

    tok = AutoTokenizer.from_pretrained(model_dir)
    data = tokenize_dataset(load_text_dataset(dataset), tok, seq_len=seq_len, pack=False)
    collate = PairCollator(PadToMultipleCollator(pad_token_id=tok.pad_token_id or 0))
    model = ModelSource.at(model_dir).load(dtype=torch.float32)
    ref = ModelSource.at(model_dir).load(dtype=torch.float32).eval().requires_grad_(False)
    model.train()
    plan = GlobalBatchOrder(num_examples=len(data), global_batch=global_batch, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(steps, warmup_steps, min_lr_ratio))

    def logps(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        labels = batch["labels"][:, 1:]
        token = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return (token * (labels != -100)).sum(-1)

    losses, norms, margins = [], [], []
    for step in range(steps):
        batch = collate([data[i] for i in plan.step_indices(step)])
        with torch.no_grad():
            ref_logps = logps(ref, batch)
        ratio = logps(model, batch) - ref_logps
        n = ratio.shape[0] // 2
        loss = -torch.nn.functional.logsigmoid(beta * (ratio[:n] - ratio[n:])).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        losses.append(loss.item())
        margins.append((beta * (ratio[:n] - ratio[n:])).mean().item())
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, norms, margins


def _schedule(steps: int, warmup_steps: int, min_lr_ratio: float):
    """hf-tp's schedule, written out: warmup (step + 1) / (warmup + 1) (the first step is not at lr
    0), then HF's cosine decay to min_lr_ratio (get_cosine_with_min_lr_schedule_with_warmup's formula)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)) * (1 - min_lr_ratio) + min_lr_ratio)

    return factor
