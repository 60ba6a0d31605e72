"""The parity harness every parity test uses: run plain HF and hf_tp on the same weights/batch.

The reference is always a plain single-process HF model; the candidate is a deep copy of it
parallelized with hf_tp. Both go through ``train_steps`` so the only difference is hf_tp.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hf_tp
from hf_tp.core.mesh import dp_mesh_of
from hf_tp.core.record import record_of
from hf_tp.verify.compare import KEY_BIASES, adam_error  # noqa: F401 - KEY_BIASES: for tests.image_grid
from tests.helpers import (
    assert_close_dict,
    batch,
    full,
    full_grads,
    full_params,
    parity_dtype,
    tiny_config,
    tiny_model,
)


@dataclass
class Trace:
    logits: torch.Tensor  # first forward, global view
    grads: dict[str, torch.Tensor]  # after the first backward
    losses: list[float]
    params: dict[str, torch.Tensor]  # after the last step
    start: dict[str, torch.Tensor]  # before the first step


def train_steps(
    model, batch: dict, steps: int = 3, lr: float = 1e-3, ctx=contextlib.nullcontext, dp_group=None, micro: int = 1
) -> Trace:
    """``steps`` AdamW steps on ``batch`` with HF's own ``labels=`` loss.

    With ``dp_group`` each dp rank holds an equal slice of the rows (all tokens valid), so the
    global-batch loss is the mean of the dp ranks' losses. ``micro`` > 1 splits the rows into
    that many micro-batches, each with its own backward (gradients accumulate between them; all
    tokens valid, so the mean of their losses is the batch's).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses, logits, grads, start = [], None, None, full_params(model)
    rows = batch["input_ids"].shape[0] // micro
    for step in range(steps):
        loss, step_logits = 0.0, []
        for m in range(micro):
            part = {k: v[m * rows : (m + 1) * rows] for k, v in batch.items()}
            with ctx():
                out = model(**part, use_cache=False)
                (out.loss / micro).backward()
            loss = loss + full(out.loss).detach() / micro
            step_logits.append(full(out.logits).detach().clone())
        if dp_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)
        losses.append(loss.item())
        if step == 0:
            logits = torch.cat(step_logits)
            grads = full_grads(model)
        opt.step()
        opt.zero_grad()
    return Trace(logits=logits, grads=grads, losses=losses, params=full_params(model), start=start)


def assert_weights_after_adam_close(
    got: dict, want: dict, start: dict, grads: dict | None = None, got_grads: dict | None = None, uncapped=()
) -> None:
    """Tensor by tensor: |W_got - W_want| <= 1e-3 |W_want - W_start| + 1e-7 (norms), over the
    elements whose first gradient is resolved (:func:`hf_tp.verify.compare.adam_error`, which
    ``hf-tp verify`` holds its layouts to as well); ``uncapped``: name prefixes of hyper-connection
    mixers' parameters (see there)."""
    error = adam_error(got, want, start, grads, got_grads, uncapped=tuple(uncapped))
    assert not error.missing, sorted(error.missing)
    assert error.rel <= 1e-3, f"param {error.where}: |diff|={error.abs:.3g}, {error.rel:.3g} of its update"


def assert_parity(got: Trace, want: Trace, rows: slice = slice(None), uncapped=()) -> None:
    """Logits (the given batch rows), every gradient and the loss curve to fp32 tolerance; then
    the weights after the AdamW steps.

    """
    torch.testing.assert_close(got.logits, want.logits[rows], rtol=1e-5, atol=1e-5)
    assert_close_dict(got.grads, want.grads, "grad")
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5, atol=0)
    assert_weights_after_adam_close(got.params, want.params, want.start, want.grads, got.grads, uncapped)


@dataclass
class ParityCase:
    """One parity scenario: a tiny model of ``family`` trained at (tp, dp) versus plain HF."""

    family: str
    tied: bool = False
    tp: int = 2
    dp: int = 1
    dp_replicate: int = 1  # HSDP: dp = dp_replicate replicas x dp / dp_replicate ranks sharding the weights
    attn: str = "sdpa"
    pad: str | None = "right"
    heads: int = 4
    kv: int = 2
    s: int = 13
    b: int = 2
    sp: bool = True
    lp: bool = True
    ac: bool = False
    compile: bool = False
    micro: int = 1  # micro-batches per step on each dp rank (hf_tp side; the reference takes the batch at once)
    dtype: torch.dtype | None = None  # None: parity_dtype(family)

    def reference(self):
        """Build the model and batch (call in one thread: it draws from the CPU RNG) and run
        plain single-process HF on the whole batch."""
        config = tiny_config(self.family, tied=self.tied, heads=self.heads, kv_heads=self.kv)
        ref = tiny_model(config, attn=self.attn, dtype=self.dtype or parity_dtype(self.family))
        data = batch(config.vocab_size, b=self.b, s=self.s, pad=self.pad)
        start = copy.deepcopy(ref)
        return start, data, train_steps(ref, data)

    def check(self, model, data: dict, want: Trace) -> None:
        """On one rank: parallelize ``model`` (an untouched copy of the reference), train it on
        this dp rank's rows and assert parity."""
        mesh = hf_tp.build_mesh(tp=self.tp, dp=self.dp, device_type="cpu", dp_replicate=self.dp_replicate)
        hf_tp.parallelize(
            model,
            mesh,
            sequence_parallel=self.sp,
            loss_parallel=self.lp,
            activation_checkpointing=self.ac,
            compile=self.compile,
        )
        q = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(q, DTensor) and q.to_local().numel() == q.numel() * self.dp_replicate // (self.tp * self.dp)
        if self.tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight
        rows = slice(None)
        if self.dp > 1:
            per = self.b // self.dp
            d = mesh.get_local_rank("dp")
            rows = slice(d * per, (d + 1) * per)
        local = {k: v[rows] for k, v in data.items()}
        ctx = hf_tp.loss_parallel if self.lp else contextlib.nullcontext
        dp_group = dp_mesh_of(mesh).get_group() if self.dp > 1 else None
        got = train_steps(model, local, ctx=ctx, dp_group=dp_group, micro=self.micro)
        assert_parity(got, want, rows)
        if self.sp:  # the norm weights' Partial gradients went through the fused all-reduce, every backward
            assert record_of(model).partial_grads.flushes == len(got.losses) * self.micro
