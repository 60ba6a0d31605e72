"""One rank of ``hf-tp verify``: the random cut model, its single-rank reference, the layout under
test, and the checks in order (logits, loss, gradients, buffers, AdamW steps, checkpoint resume
on another mesh, export round trip)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hf_tp.core.model_source import ModelSource
from hf_tp.run.config import TrainConfig
from hf_tp.verify import candidate, roundtrip
from hf_tp.verify.compare import adam_error, stream_mixer_params, tensor_error
from hf_tp.verify.injected_faults import requested
from hf_tp.verify.measured import gradients_check
from hf_tp.verify.random_model import make_batch, random_model, save_model
from hf_tp.verify.report import ADAM, EXACT, NORM, UNRESOLVED, VALUES, Check
from hf_tp.verify.single_rank import Settings, exact_grads, reference_run

# from_pretrained is not thread-safe (ranks run as threads of one process in the unit tests)
_LOADING = threading.Lock()
LORA_B_STD = 0.1  # LoRA's B starts at zero in training; random here, so the first gradients reach A


def verify_rank(cfg: TrainConfig, work: Path, device: torch.device) -> tuple[str, list[Check]]:
    """(what was checked, in words; the checks of ``cfg``'s layout on this rank). The process
    group is up; ``work`` is a folder every rank can read (the checkpoint is written there)."""
    from hf_tp.adapters.shrink import cut_config

    fault = requested()
    config = cut_config(ModelSource.for_shapes(cfg.model).config, cfg.tp, cfg.seq_len)
    about = describe(cfg, config, device)
    if dist.get_rank() == 0:  # rank 0 draws the weights; every rank's reference and candidate load them
        save_model(random_model(config, cfg.seed), work / "model")
    dist.barrier()
    cfg = dataclasses.replace(cfg, model=str(work / "model"), dtype="fp32")
    with _LOADING:
        ref = ModelSource.at(cfg.model).load(dtype=torch.float32).train()
    ref, peft, lora_state = _with_lora(ref, cfg)
    ref.to(device)
    batch = {k: v.to(device) for k, v in make_batch(config.vocab_size, _rows(cfg), cfg.seq_len, cfg.seed + 1).items()}
    s = candidate.settings_of(cfg)
    exact = exact_grads(ref, batch)  # a float64 copy's, before the reference trains the model
    want = reference_run(ref, batch, s)
    mesh = _mesh(cfg, device)
    model, opt, rank = candidate.run(cfg, mesh, device, lora_state, fault)
    try:
        logits = candidate.first_forward(model, batch, rank)
    except Exception as exc:  # noqa: BLE001 - a layout that cannot run: reported, the rest not run
        return about, [Check.crashed("logits", exc)] + [Check.skipped(n, "the first forward failed") for n in LATER]
    checks = [
        Check.of(
            "logits",
            tensor_error({"logits": logits}, {"logits": candidate.want_logits(model, want.logits, rank)}),
            VALUES,
        )
    ]
    got = candidate.train(model, opt, batch, rank, s, s.steps)
    mixers = stream_mixer_params(ref)
    checks += _training_checks(got, want, mixers, exact)
    ckpt = roundtrip.save(cfg, work, model, opt)
    more = candidate.train(model, opt, batch, rank, s, 1)  # what a resumed run's next step must give
    checks.append(_resume(cfg, ckpt, device, lora_state, batch, s, got, more, mixers))
    ref.load_state_dict(got.params, strict=False)  # the export must hold the layout's own weights
    error = roundtrip.on_rank0(lambda: roundtrip.export_error(ckpt, work / "export", peft or ref, bool(peft)))
    checks.append(Check.of("export round trip", error, EXACT))
    return about, checks


def describe(cfg: TrainConfig, config, device: torch.device) -> str:
    """The header line: the layout, the cut model and the data."""
    layout = f"tp {cfg.tp}" + (f" x cp {cfg.cp}" if cfg.cp > 1 else "") + f" x dp {cfg.dp}"
    layout += (f" (ep {cfg.ep})" if cfg.ep > 1 else "") + (f", LoRA r {cfg.lora_r}" if cfg.lora_r else "")
    return (
        f"hf-tp verify: {layout} on {cfg.world_size} {device.type} rank{'s' if cfg.world_size > 1 else ''} vs one "
        f"rank; {cfg.model} cut to {config.num_hidden_layers} layer{'s' if config.num_hidden_layers > 1 else ''} "
        f"(one of each kind), hidden {config.hidden_size}, vocab {config.vocab_size}, random fp32 weights; "
        f"{_rows(cfg)} rows of {cfg.seq_len} tokens, {cfg.max_steps} AdamW steps"
    )


LATER = ("loss", "gradients", "gradient norm", "buffers", "AdamW steps", "checkpoint resume", "export round trip")


def _training_checks(got, want, mixers: tuple[str, ...], exact: dict[str, torch.Tensor]) -> list[Check]:
    """The checks of a training run against the reference's; ``mixers``: hyper-connection mixers'
    parameter prefixes (:func:`adam_error`'s ``uncapped``); ``exact``: a float64 copy's first
    gradients (:mod:`hf_tp.verify.measured`)."""
    losses = tensor_error({"loss": torch.tensor(got.losses)}, {"loss": torch.tensor(want.losses)})
    # the first step's norm: later ones are of weights that AdamW already moved apart by round-off
    norms = tensor_error({"norm": torch.tensor(got.grad_norms[:1])}, {"norm": torch.tensor(want.grad_norms[:1])})
    return [
        Check.of(f"loss ({len(got.losses)} steps)", losses, VALUES),
        gradients_check(got.grads, want.grads, exact),
        Check.of("gradient norm (first step)", norms, NORM),
        Check.of("buffers", tensor_error(got.buffers, want.buffers), VALUES),
        Check.of(
            "AdamW steps",
            adam_error(got.params, want.params, want.start, want.step_grads, got.step_grads, UNRESOLVED, mixers),
            ADAM,
        ),
    ]


def _resume(cfg, ckpt: Path, device, lora_state, batch, s: Settings, saved, more, mixers: tuple[str, ...]) -> Check:
    """Load the checkpoint on another mesh: the weights must be the ``saved`` ones, and one more
    step must take them where the layout's own next step took them (``more``): weights, AdamW
    moments and step count all carried over (``mixers``: as in :func:`_training_checks`)."""
    try:
        other, model, opt, rank = roundtrip.resume_model(cfg, device, lora_state, candidate.run)
    except ValueError as exc:
        return Check.skipped("checkpoint resume", str(exc))
    name = f"checkpoint resume (tp {other.tp} x dp {other.dp})"
    try:
        roundtrip.load(ckpt, model, opt)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank: the check fails naming why
        return Check.crashed(name, exc)
    from hf_tp.verify.compare import full_params

    loaded = tensor_error(full_params(model, trainable_only=True), saved.params)
    if loaded.rel > EXACT or loaded.missing:
        return Check.of(name + ": loaded weights", loaded, EXACT)
    step = candidate.train(model, opt, batch, rank, s, 1)
    # the step's update is judged with the moments both runs carry: the saved steps' gradients, then its own
    want, got = saved.step_grads + more.step_grads, saved.step_grads + step.step_grads
    error = adam_error(step.params, more.params, more.start, want, got, UNRESOLVED, mixers, judged=1)
    return Check.of(name, error, ADAM)


def _with_lora(model, cfg: TrainConfig):
    """(the model, its peft wrapper or None, the LoRA factors' full initial state or None): LoRA
    adapters put into ``model`` as training puts them, B drawn at random (training starts it at
    zero, where the first gradients would not reach A)."""
    if not cfg.lora_r:
        return model, None, None
    from hf_tp.lora.peft_models import lora_init_state
    from hf_tp.run.model import with_lora

    peft = with_lora(model, cfg)  # in place: ``model`` now holds the adapters, as the candidate does
    state = lora_init_state(model, cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed + 2)
    for key, value in state.items():
        if ".lora_B." in key:
            state[key] = (torch.randn(value.shape, generator=g) * LORA_B_STD).to(value.dtype)
    model.load_state_dict(state, strict=False)
    return model, peft, state


def _rows(cfg: TrainConfig) -> int:
    """Rows of the global batch: one per rank (at least two), so every mesh of these ranks splits it."""
    return max(2, cfg.world_size)


def _mesh(cfg: TrainConfig, device: torch.device):
    from hf_tp.core.mesh import build_mesh

    return build_mesh(tp=cfg.tp, dp=cfg.dp, cp=cfg.cp, device_type=device.type, dp_replicate=cfg.dp_replicate)


def work_dir(cfg: TrainConfig) -> tuple[Path, bool]:
    """(the folder for the saved model, checkpoint and export; whether verify made it): the given
    output dir (checked before launch: new, empty or verify's; marked as verify's by rank 0), else a
    temporary folder made by rank 0 (one node: every rank sees it)."""
    if cfg.output_dir:
        from hf_tp.verify.folder import claim

        if dist.get_rank() == 0:
            claim(Path(cfg.output_dir))
        dist.barrier()
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)  # another node's view of it
        return Path(cfg.output_dir), False
    box = [tempfile.mkdtemp(prefix="hf_tp-verify-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]), True


def remove(work: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(work, ignore_errors=True)
