"""Distributed checkpoints (torch DCP) that are published atomically and can be resharded.

Layout of ``OUTPUT_DIR/checkpoints/step-N``: DCP shards of ``{"model", "optim"}``, ``trainer_state.json``
(step, LR scheduler, run fingerprint), ``rng.pt``, ``model_files/`` (config + tokenizer, for export),
and ``COMPLETE``. Everything is written under ``.tmp-step-N`` and renamed when complete, so a crash
mid-save never leaves a directory that looks like a checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hf_tp.checkpoint.checkpoint_dirs import (
    MARKER,
    checkpoint_root,
    complete_checkpoints,
    latest_checkpoint,
    load_trainer_state,
)
from hf_tp.checkpoint.hf_folder import base_dtype, base_source
from hf_tp.checkpoint.integrity import write_manifest
from hf_tp.checkpoint.packed import checkpoint_layout, write_back
from hf_tp.checkpoint.remote_code import copy_model_code
from hf_tp.checkpoint.safe_load import SafeReader, safe_load

__all__ = [
    "MARKER",
    "checkpoint_root",
    "complete_checkpoints",
    "crash_point",
    "latest_checkpoint",
    "load_checkpoint",
    "load_trainer_state",
    "save",
    "save_checkpoint",
]


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    model_files: list[Any],
    keep: int = 0,
) -> Path:
    """Collective: every rank writes its shards; rank 0 publishes. Returns the final path.

    ``model_files`` are objects with ``save_pretrained`` (config, tokenizer) saved for export.
    ``keep`` > 0 deletes all but the newest ``keep`` complete checkpoints after publishing.
    """
    root = checkpoint_root(output_dir)
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
    dist.barrier()
    state = checkpoint_layout(_train_state(model, optimizer), model)  # one layout on every mesh
    failure: BaseException | None = None
    try:
        dcp.save(state, checkpoint_id=str(tmp))  # collective: a rank's write error is raised on every rank
        if rank == 0:
            _write_rank0_files(tmp, step, trainer_state, model_files, model)
    except (OSError, CheckpointException) as exc:
        failure = exc
    crash_point("save", step)
    _agree_saved(failure, root, tmp, step)
    if rank == 0:
        _fsync_write(tmp / MARKER, f"step {step}\n")
        if final.exists():  # a re-run of the same step after resume: replace the old copy
            shutil.rmtree(final)
        os.rename(tmp, final)
        if keep > 0:  # only now, with the new checkpoint published, may older ones go
            for old in complete_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _write_rank0_files(
    tmp: Path, step: int, trainer_state: dict[str, Any], model_files: list[Any], model: torch.nn.Module
) -> None:
    """Config, tokenizer (and the model's own code, for a --trust-remote-code run), RNG and trainer
    state beside the shards, then the size manifest."""
    for obj in model_files:
        obj.save_pretrained(tmp / "model_files")
    copy_model_code(model, tmp / "model_files")
    torch.save({"cpu": torch.get_rng_state()}, tmp / "rng.pt")
    recorded = {"step": step, **trainer_state}
    if "base_dtype" not in recorded:  # what export casts to by default (the base folder may be gone by then)
        recorded["base_dtype"] = base_dtype(base_source(recorded))
    _fsync_write(tmp / "trainer_state.json", json.dumps(recorded, indent=2))
    write_manifest(tmp)


def _agree_saved(failure: BaseException | None, root: Path, tmp: Path, step: int) -> None:
    """Collective: every rank learns whether any rank failed to write; then all raise together
    (the half-written directory removed, every earlier checkpoint untouched) or all go on."""
    codes: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(codes, 0 if failure is None else 1)
    if not any(codes):
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    latest = latest_checkpoint(root.parent)
    need = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) if latest else 0
    free = shutil.disk_usage(root).free
    reason = _space_problem(failure, free, need) if failure is not None else None
    if reason is None and isinstance(failure, CheckpointException):  # a BaseException: raise what a rank hit
        inner = next(iter(failure.failures.values()))
        raise inner[0] if isinstance(inner, tuple) else inner
    if reason is None and failure is not None:
        raise failure
    if reason is None:
        raise RuntimeError(f"checkpoint step-{step}: another rank failed to write its part (see its error)")
    raise ValueError(
        f"checkpoint step-{step} could not be written to {root}: {reason}; {free / 2**30:.2f} GiB free"
        + (f", about {need / 2**30:.3f} GiB needed (the size of {latest.name})" if latest else "")
        + ". The half-written checkpoint was removed and earlier checkpoints are intact: free space (or "
        "lower --keep-checkpoints) and continue with --resume"
    )


def _space_problem(exc: BaseException, free: int, need: int) -> str | None:
    """Why a failed write was out of space (a full disk, a quota, a file-size limit), or None. The
    error itself may not say: torch's serializer turns a short write into "unexpected pos"."""
    import resource

    seen: list[BaseException] = [exc]
    codes = set()
    while seen:
        e = seen.pop()
        if isinstance(e, OSError):
            codes.add(e.errno)
        for failure in getattr(e, "failures", {}).values():  # CheckpointException: rank -> (exc, traceback)
            seen.append(failure[0] if isinstance(failure, tuple) else failure)
        seen += [c for c in (e.__cause__, e.__context__) if c is not None]
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if errno.EFBIG in codes or (limit != resource.RLIM_INFINITY and not codes - {errno.EFBIG}):
        return f"a file-size limit (ulimit -f: {limit} bytes per file) was hit"
    if errno.EDQUOT in codes:
        return "the disk quota is used up"
    if errno.ENOSPC in codes or free < need:
        return "the disk is full"
    return None


def save(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any = None,
    *,
    keep: int = 0,
) -> Path:
    """``hf_tp.save_checkpoint``: collective; every rank calls it. Writes
    ``output_dir/checkpoints/step-{step}`` (model and optimizer shards, the model's config and
    generation config, the tokenizer if given), which :func:`hf_tp.export` turns into a
    ``from_pretrained`` folder (its model card names the model it was loaded from). Returns its path."""
    files = [model.config, getattr(model, "generation_config", None), tokenizer]
    state = {"base_model": getattr(model.config, "name_or_path", None) or None}
    return save_checkpoint(output_dir, step, model, optimizer, state, [f for f in files if f is not None], keep=keep)


def _train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint holds: the trainable tensors and their optimizer state. Frozen weights (a
    LoRA run's base) are left out: every run reads them from the model folder."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    model_state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    model_state = {k: v for k, v in model_state.items() if k not in frozen}  # a tied alias of a frozen one too
    return {"model": model_state, "optim": get_optimizer_state_dict(model, optimizer)}


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: load model and optimizer into the current (possibly different) mesh; DCP reshards.
    Nothing in the checkpoint is unpickled beyond plain data (:mod:`hf_tp.checkpoint.safe_load`).
    Packed expert weights are read through views in the checkpoint's layout (:mod:`hf_tp.checkpoint.packed`)."""
    state = _train_state(model, optimizer)
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    dropped = _drop_unsaved_optimizer_state(state["optim"], metadata.state_dict_metadata)
    copies: list = []  # packed tensors the mesh shards on their packed dim: read into copies
    safe_load(checkpoint_layout(state, model, metadata, path, copies), path, reader=reader)
    write_back(copies)
    set_model_state_dict(model, state["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    # not strict only where parameters had no state to load: DCP found every other entry above
    set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=not dropped))
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    return load_trainer_state(path)


def _drop_unsaved_optimizer_state(optim_state: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Leave out the optimizer state of parameters the checkpoint holds none for: trainable
    parameters that never got a gradient in the saved run (an indexer behind a boolean selection),
    so AdamW never made their state. torch's state dict made one for every trainable parameter (a
    zero-gradient step), which DCP would then look for. Without an entry such a parameter is as it
    was in the saved run; every rank reads the same metadata, so every rank drops the same ones."""
    prefixes = {key.rpartition(".")[0] for key in saved if key.startswith("optim.state.")}
    unsaved = [f for f in optim_state.get("state", {}) if f"optim.state.{f}" not in prefixes]
    for fqn in unsaved:
        del optim_state["state"][fqn]
    return bool(unsaved)


def crash_point(where: str, step: int) -> None:
    """Fault injection for the fault tests: ``HF_TP_CRASH=where:step:rank[:SIGNAL]`` sends that rank
    SIGNAL (default KILL; e.g. USR1 to preempt, STOP to hang) at that point (where: ``train`` = start
    of the step, ``save`` = shards written, not published); ``SLEEP<seconds>`` instead holds the
    rank there, so that a signal from outside lands inside that step, not after the last one (the
    file ``HF_TP_CRASH_MARK`` names, if set, is created as the hold starts: send it then)."""
    spec = os.environ.get("HF_TP_CRASH")
    if not spec:
        return
    w, s, r, *sig = spec.split(":")
    if w == where and int(s) == step and int(r) == dist.get_rank():
        if sig and sig[0].startswith("SLEEP"):
            if mark := os.environ.get("HF_TP_CRASH_MARK"):
                open(mark, "w").close()
            time.sleep(float(sig[0].removeprefix("SLEEP")))
            return
        os.kill(os.getpid(), getattr(signal, f"SIG{sig[0] if sig else 'KILL'}"))
