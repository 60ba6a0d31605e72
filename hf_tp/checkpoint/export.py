"""DCP checkpoint (any mesh) -> a plain HF model folder, offline, in one process, no optimizer."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from hf_tp.checkpoint.layout import MARKER, latest_checkpoint, load_trainer_state

DTYPES = ("fp32", "bf16", "fp16")  # torch, transformers: imported once the checkpoint is found


def resolve_checkpoint(path: str | Path) -> Path:
    """A ``step-N`` checkpoint dir, or a run's output dir (its newest complete checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p} does not exist (expected a run's OUTPUT_DIR or OUTPUT_DIR/checkpoints/step-N)")
    if (p / MARKER).is_file():
        return p
    if (p / "checkpoints").is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise ValueError(f"no complete checkpoint in {p / 'checkpoints'} (half-written ones are ignored)")
        return latest
    if (p / ".metadata").is_file():
        raise ValueError(f"{p} is an incomplete checkpoint (no {MARKER} marker: its save did not finish)")
    if (p / "metrics.jsonl").is_file() or (p / "config.yaml").is_file():
        raise ValueError(
            f"the run in {p} saved no checkpoint; train with --save-every N (checkpoints every N steps) or "
            "--export-on-finish (a final checkpoint, exported to OUTPUT_DIR/export)"
        )
    raise ValueError(f"not a checkpoint: {p} (expected a run's OUTPUT_DIR or OUTPUT_DIR/checkpoints/step-N)")


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "fp32",
    overwrite: bool = False,
    max_shard_size: str = "5GB",
) -> Path:
    """Write ``out_dir`` with safetensors weights, config, generation config, tokenizer and a card.

    Reads only the model's tensors from the DCP checkpoint (DCP gathers every shard, whatever the
    mesh was). Saving goes through ``save_pretrained``, which writes exactly what
    ``from_pretrained`` expects (tied weights stored once, an index when sharded). The folder is
    built next to ``out_dir`` and renamed into place, so a crash never leaves half an export.
    """
    ckpt = resolve_checkpoint(checkpoint)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"export dir {out} is not empty; pass another dir or --overwrite")
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    files = ckpt / "model_files"
    config = AutoConfig.from_pretrained(files)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    state = model.state_dict()  # tied weights: two keys, one storage, filled once
    _stored_shapes(state, ckpt)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=True)  # also inside a running job
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        for f in files.iterdir():  # tokenizer files and the source's generation config
            if f.is_file() and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        (tmp / "README.md").write_text(_model_card(ckpt, config, dtype))
        _ordinary_permissions(tmp)  # mkdtemp makes the folder 700, safetensors its files 600
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _stored_shapes(state: dict, ckpt: Path) -> None:
    """Point the keys hf_tp stores in another shape (packed expert gate/up halves apart:
    ``[experts, 2, n, hidden]`` for HF's ``[experts, 2n, hidden]``) at views of the HF tensors in
    that shape: the same numbers in the same order, so DCP fills the HF tensor in place."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    for key, tensor in state.items():
        meta = stored.get(f"model.{key}")
        size = tuple(getattr(meta, "size", ()) or ())
        if size and size != tuple(tensor.shape) and math.prod(size) == tensor.numel():
            state[key] = tensor.view(size)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _ordinary_permissions(folder: Path) -> None:
    """Dirs 777 and files 666 less the umask (755 and 644 with the usual 022), as ``mkdir`` and
    ``open`` would have made them."""
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def describe_source(source: str | None, kind: str) -> tuple[str, str | None]:
    """How a model card names a run's ``--model``/``--dataset``: (display name, Hub id or None).

    A Hub id is itself; a snapshot in the Hub cache is its repo id; hf_tp's embedded default is
    named as such; any other local path is its folder or file name (not the machine's path)."""
    if not source:
        return f"unknown {kind}", None
    from hf_tp.demo.assets import ASSETS_NAME

    path = Path(source).expanduser()
    parts = path.parts
    if ASSETS_NAME in parts:
        what = "tiny Llama (random init)" if kind == "model" else "generated toy corpus"
        return f"hf_tp's embedded {what}", None
    prefix = "models--" if kind == "model" else "datasets--"
    repo = next((p[len(prefix) :].replace("--", "/") for p in parts if p.startswith(prefix)), None)
    if repo is not None:
        return repo, repo
    if not path.exists() and not source.startswith((".", "/", "~")):
        return source, source  # a Hub id
    return f"local {kind} `{path.name}`", None


def _model_card(ckpt: Path, config, dtype: str) -> str:
    state = load_trainer_state(ckpt)
    run = state.get("config", {})
    base = run.get("model") or state.get("base_model")  # hf-tp train's --model, or hf_tp.save_checkpoint's
    model, model_id = describe_source(base, "model")
    dataset, dataset_id = describe_source(run.get("dataset"), "dataset")
    meta = ["library_name: transformers", "tags:", "- hf_tp"]
    if model_id:
        meta.append(f"base_model: {model_id}")
    if dataset_id:
        meta += ["datasets:", f"- {dataset_id}"]
    if run:
        training = (
            f"- training: {state['step']} optimizer steps, tp={run.get('tp')} dp={run.get('dp')}, "
            f"global batch {run.get('batch_size')}x{run.get('dp')}x{run.get('grad_accum')} sequences of "
            f"{run.get('seq_len')} tokens, lr {run.get('lr')}\n"
        )
    else:
        training = f"- training: {state['step']} optimizer steps\n"
    title = model if base else config.model_type
    return (
        "---\n" + "\n".join(meta) + "\n---\n\n"
        f"# {title}, trained with hf_tp\n\n"
        f"- base model: {model if base else 'not recorded'}\n"
        f"- architecture: `{config.model_type}`, {config.num_hidden_layers} layers, hidden {config.hidden_size}\n"
        + training
        + (f"- dataset: {dataset}\n" if run.get("dataset") else "")
        + f"- weights exported in {dtype} from `{ckpt.name}`\n\n"
        "Load with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.\n"
    )
