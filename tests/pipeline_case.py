"""One pipeline-parallel parity scenario: a tiny HF model trained a few AdamW steps at pp x dp x cp x tp
(ep inside each stage's dp x cp) with one of torch's schedules versus plain single-process HF on the
whole batch."""

from __future__ import annotations

import copy
import shutil
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import hf_tp
from hf_tp.adapters import get_adapter
from hf_tp.checkpoint.dcp import load_checkpoint
from hf_tp.checkpoint.dcp import save as save_checkpoint
from hf_tp.context.token_share import state_of
from hf_tp.core.mesh import dp_mesh_of, stage_dims
from hf_tp.core.record import record_of
from hf_tp.moe.expert_parallel import experts_modules
from hf_tp.parallel.held_out import evaluate_pipeline
from hf_tp.pipeline.pipeline_build import pipeline_parallelize
from hf_tp.pipeline.schedules import Pipeline
from hf_tp.run.loss import loss_context
from hf_tp.verify.compare import adam_error, full_grads
from tests.family_grid import grid_config, grid_model
from tests.helpers import FAMILY_SETTINGS, assert_close_dict, batch, full_params, tiny_config, tiny_model
from tests.lora_grid import lora
from tests.parity import assert_weights_after_adam_close

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class PipelineCase:
    family: str
    pp: int = 2
    tp: int = 1
    dp: int = 1
    dp_replicate: int = 1  # HSDP inside each stage
    cp: int = 1  # context parallelism inside each stage (s a multiple of 2 x cp x tp)
    ep: int = 1  # expert parallelism inside each stage (borrowed from dp x cp)
    schedule: str = "1f1b"
    microbatches: int = 2
    virtual: int = 1
    layers: int = 4
    b: int = 4  # rows of the global batch (b / dp per dp rank)
    s: int = 13
    steps: int = 3
    dtype: str = "float32"
    overrides: dict = field(default_factory=dict)
    resume: dict | None = None  # {"at": S, "tp": T, "dp": D}: saved after step S, resumed without pp at tp T x dp D
    lora: int = 0  # a peft LoRA model of this rank (all-linear, random non-zero adapters) against plain peft
    tied: bool = False  # lm_head tied to the embedding (a copy on the first and the last stage)
    accum: int = 1  # micro-steps per optimizer step (gradient accumulation; FSDP2 reduces on the last)
    grads: bool = False  # every gradient this rank holds after step 1 against plain HF's (LoRA: always, adapters)

    def reference(self) -> tuple[torch.nn.Module, dict, list[float], dict, dict, dict, tuple[dict, float]]:
        """(untouched model copy, batch, reference losses, start params, final params, first
        step's gradients, (held-out batch, the trained model's cross entropy on it)): plain HF (or
        peft) on the whole batch (every rank builds the same one from the same seeds)."""
        if self.family in FAMILY_SETTINGS:
            config = tiny_config(self.family, tied=self.tied, num_hidden_layers=self.layers, **self.overrides)
            ref = tiny_model(config, dtype=DTYPES[self.dtype])
        else:  # the family grid's settings (MoE sizes, float64, eager experts)
            config = grid_config(self.family, num_hidden_layers=self.layers, **self.overrides)
            ref = grid_model(config)
        model = lora(ref, r=self.lora) if self.lora else ref  # the peft model holds ref, adapters added in place
        data = batch(config.vocab_size, b=self.b, s=self.s, pad="right")
        model, start = copy.deepcopy(model), full_params(ref)
        opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
        losses, grads = [], {}
        for _ in range(self.steps):
            loss = ref(**data, use_cache=False).loss
            loss.backward()
            losses.append(loss.item())
            grads = grads or full_grads(ref)
            opt.step()
            opt.zero_grad()
        held_out = batch(config.vocab_size, b=self.b, s=self.s, pad="left", seed=2)
        no_aux = {"output_router_logits": False} if getattr(config, "output_router_logits", False) else {}
        with torch.no_grad():
            eval_loss = ref(**held_out, use_cache=False, **no_aux).loss.item()
        return model, data, losses, start, full_params(ref), grads, (held_out, eval_loss)

    def check(self) -> tuple[float, float, float]:
        """Train the pipeline on this rank's rows and assert the loss curve (rel 1e-5), every
        weight this rank holds after the steps and the trained model's held-out loss (rel 1e-5,
        :func:`hf_tp.parallel.held_out.evaluate_pipeline`; ``hf_tp.evaluate`` when resumed
        without pp); returns the largest relative loss difference, this rank's largest weight
        difference relative to its AdamW update and the held-out loss's relative difference."""
        model, data, want, start, end, want_grads, (held_out, want_eval) = self.reference()
        fresh = copy.deepcopy(model) if self.resume else None  # the model the resumed run loads into
        pipe, mesh = self._pipeline(model, self.pp, self.tp, self.dp, self.schedule, self.virtual, self.dp_replicate)
        for stage in pipe.models:  # cp and ep applied inside every stage, over its own ranks
            record, adapter = record_of(stage), get_adapter(stage.config)
            assert (state_of(stage) is not None) == (self.cp > 1)
            moe = bool(experts_modules(stage, adapter.layers_path, adapter.experts))  # (not a stage of dense layers)
            assert bool(record.experts) == (self.ep > 1 and moe) == ("ep" in record.meshes)
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-3, weight_decay=0.01)
        steps = self.resume["at"] if self.resume else self.steps
        got = self._train(pipe, mesh, opt, data, steps, want_grads if self.lora or self.grads else None, self.accum)
        if self.resume:
            fresh, mesh, resumed = self._resumed(fresh, pipe.checkpoint_model, opt, data)
            got += resumed
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
        assert worst <= 1e-5, f"{self}: losses {got} vs {want}"
        held = {n: p for m in (fresh or pipe).models for n, p in full_params(m).items()}
        assert held, "this rank holds no parameters"
        want_held, start_held = {n: end[n] for n in held}, {n: start[n] for n in held}
        assert_weights_after_adam_close(held, want_held, start_held)
        rows, r = self.b // mesh["dp"].size(), mesh.get_local_rank("dp")
        mine = [{k: v[r * rows : (r + 1) * rows] for k, v in held_out.items()}]
        run = fresh or pipe
        with loss_context(mesh["tp"].size() > 1):
            result = evaluate_pipeline(run, mine) if isinstance(run, Pipeline) else hf_tp.evaluate(run.models[0], mine)
        eval_diff = abs(result.loss - want_eval) / abs(want_eval)
        assert eval_diff <= 1e-5, f"{self}: held-out loss {result.loss} vs {want_eval}"
        return worst, adam_error(held, want_held, start_held).rel, eval_diff

    def _pipeline(self, model, pp: int, tp: int, dp: int, schedule: str, virtual: int, replicate: int = 1) -> tuple:
        """(``model`` parallelized at pp x dp x tp with ``schedule``, or without pp as a
        :class:`Whole`; the mesh)."""
        cp, ep = (self.cp, self.ep) if pp > 1 else (1, 1)  # (resumed without pp: tp x dp alone)
        mesh = hf_tp.build_mesh(tp=tp, dp=dp, pp=pp, cp=cp, device_type="cpu", dp_replicate=replicate)
        if pp == 1:
            hf_tp.parallelize(model, mesh)
            return Whole(model), mesh
        kwargs = dict(schedule=schedule, microbatches=self.microbatches, virtual_stages=virtual, ep=ep)
        return pipeline_parallelize(model, mesh, **kwargs), mesh

    def _train(
        self, pipe, mesh, opt, data: dict, steps: int, want_grads: dict | None = None, accum: int = 1
    ) -> list[float]:
        """``steps`` AdamW steps of ``pipe`` (a pipeline or a :class:`Whole`) on this dp rank's rows;
        the losses (over every rank). ``want_grads``: every gradient this rank holds after step 1
        must be these (LoRA: adapters only); ``accum`` micro-steps per step."""
        dp, tp, r = mesh["dp"].size(), mesh["tp"].size(), mesh.get_local_rank("dp")
        rows = self.b // dp
        mine = {k: v[r * rows : (r + 1) * rows] for k, v in data.items()}
        targets = int((data["labels"][:, 1:] != -100).sum())
        staged = "pp" in mesh.mesh_dim_names
        groups = [mesh["pp"].get_group()] if staged else []
        groups.append(dp_mesh_of(mesh[stage_dims(mesh)] if staged else mesh).get_group())
        got = []
        for _ in range(steps):
            routing = pipe.route([mine]) if pipe.has_aux else None  # a MoE's aux loss: the counts first
            loss = 0.0
            for m, part in enumerate(_split_rows(mine, accum)):  # gradient accumulation: sync on the last
                for stage in pipe.models:
                    if isinstance(stage, FSDPModule):
                        stage.set_requires_gradient_sync(m == accum - 1)
                with loss_context(tp > 1):
                    loss = loss + pipe.step(part, targets, dp, routing.totals if routing else None)
            if routing:  # this rank's share of the aux loss
                loss += pipe.models[0].config.router_aux_loss_coef * routing.term
            for group in groups:
                dist.all_reduce(loss, group=group)
            got.append(loss.item())
            if want_grads is not None and len(got) == 1:  # every gradient this rank holds (LoRA: adapters only)
                grads = {n: g for m in pipe.models for n, g in full_grads(m).items()}
                assert grads and (not self.lora or all(".lora_" in n for n in grads)), sorted(grads)
                assert_close_dict(grads, {n: want_grads[n] for n in grads}, "grad")
            pipe.sync_tied_grads()  # a tied weight: both stages' copies get the summed gradient
            opt.step()
            opt.zero_grad()
        return got

    def _resumed(self, fresh: torch.nn.Module, saved: torch.nn.Module, opt, data: dict) -> tuple:
        """Save the pipeline run's checkpoint (``saved``: this rank's stages as one module), load it
        into ``fresh`` parallelized at the ``resume`` layout (``pp``, ``schedule``, ``virtual``
        default to no pipeline), and train the remaining steps there: (the resumed run, its mesh,
        its losses)."""
        folder = [tempfile.mkdtemp(prefix="hf_tp-pp-resume-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(folder, src=0)
        path = save_checkpoint(folder[0], self.resume["at"], saved, opt)
        at = {"pp": 1, "schedule": "1f1b", "virtual": 1, **self.resume}
        run, mesh = self._pipeline(fresh, at["pp"], at["tp"], at["dp"], at["schedule"], at["virtual"])
        opt = torch.optim.AdamW(list(run.parameters()), lr=1e-3, weight_decay=0.01)
        load_checkpoint(path, run.checkpoint_model, opt)
        losses = self._train(run, mesh, opt, data, self.steps - at["at"])
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
        return run, mesh, losses


class Whole:
    """A model parallelized without pp, driven as a :class:`hf_tp.pipeline.schedules.Pipeline` is."""

    has_aux = False

    def __init__(self, model: torch.nn.Module) -> None:
        self.models, self.checkpoint_model = [model], model

    def parameters(self):
        return self.models[0].parameters()

    def step(self, batch: dict, num_items: int, dp: int, routing=None) -> torch.Tensor:
        loss = self.models[0](**batch, num_items_in_batch=num_items, use_cache=False).loss
        (loss * dp).backward()  # FSDP2 averages over dp; the loss is already over the global targets
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()

    def sync_tied_grads(self) -> None:
        pass


def _split_rows(batch: dict, parts: int) -> list[dict]:
    """``batch``'s rows in ``parts`` equal consecutive parts."""
    rows = len(batch["input_ids"]) // parts
    return [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(parts)]
