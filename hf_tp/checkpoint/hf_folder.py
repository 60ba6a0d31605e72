"""DCP checkpoint (any mesh) -> a plain HF model folder, offline, in one process, no optimizer."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from hf_tp.checkpoint.checkpoint_dirs import MARKER, load_trainer_state
from hf_tp.checkpoint.integrity import damage, newest_good_checkpoint
from hf_tp.paths import unwritable_reason

DTYPES = ("fp32", "bf16", "fp16")  # torch, transformers: imported once the checkpoint is found
# In every export (from_pretrained, peft and Hub pushes ignore it): what --overwrite may replace.
EXPORT_MARKER = ".hf_tp_export.json"
# What to do when no checkpoint of a run is whole (hf-tp train's own advice names --resume).
EXPORT_ADVICE = "restore one from a copy, then export it by its path (OUTPUT_DIR/checkpoints/step-N)"


def resolve_checkpoint(path: str | Path) -> Path:
    """A ``step-N`` checkpoint dir, or a run's output dir (its newest complete checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p} does not exist (expected a run's OUTPUT_DIR or OUTPUT_DIR/checkpoints/step-N)")
    if (p / MARKER).is_file():
        if (problem := damage(p)) is not None:
            raise ValueError(
                f"checkpoint {p} is damaged ({problem}); export an older one, or the run dir (its newest whole one)"
            )
        return p
    if (p / "checkpoints").is_dir():
        latest = newest_good_checkpoint(p, advice=EXPORT_ADVICE)  # names damaged newer ones and falls back
        if latest is None:
            raise ValueError(
                f"no complete checkpoint in {p / 'checkpoints'} (half-written ones are ignored); "
                "hf-tp train --resume with --save-every N writes one"
            )
        return latest
    if (p / ".metadata").is_file():
        raise ValueError(
            f"{p} is an incomplete checkpoint (no {MARKER} marker: its save did not finish); "
            "export an older one, or the run dir (its newest complete one)"
        )
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
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    merge: bool = False,
    trust_remote_code: bool = False,
) -> Path:
    """Write ``out_dir`` with safetensors weights, config, generation config, tokenizer and a card.

    Streams: the checkpoint's model tensors are read a module at a time (DCP gathers every shard,
    whatever the mesh was), cast to ``dtype`` (default: the base model's dtype, fp32 where it was
    not recorded) and written to safetensors files of at most ``max_shard_size`` as they fill, with
    an index when there are several (:mod:`hf_tp.checkpoint.stream`): host memory follows the shard
    size, not the model. Tied weights are stored once. The folder is built next to ``out_dir`` and
    renamed into place, so a crash never leaves half an export. A LoRA run exports a peft adapter
    folder, or with ``merge`` the base weights with the adapters merged in (docs/lora.md). A model
    that needs its own code (a ``--trust-remote-code`` run) is refused unless ``trust_remote_code``;
    nothing in the checkpoint is unpickled beyond plain data (:mod:`hf_tp.checkpoint.safe_load`).

    Nothing else is lost: ``out_dir`` may not be a file, nor be, hold or lie inside the checkpoint,
    its run dir or the run's checkpoints folder, and ``overwrite`` replaces only an empty folder or
    an earlier export (one holding :data:`EXPORT_MARKER`); anything else is a ``ValueError`` before
    a byte is written. An ``OSError`` (a full disk) leaves ``out_dir`` as it was.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = writable_target(out_dir)  # before the checkpoint is read
    ckpt = resolve_checkpoint(checkpoint)
    refuse_overlap(ckpt, out)
    check_replaceable(out, overwrite)
    state = load_trainer_state(ckpt)
    chosen = dtype or state.get("base_dtype") or base_dtype(base_source(state))
    how = "as asked" if dtype else ("the base model's dtype" if chosen else "the base model's dtype was not recorded")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        lora = bool((state.get("config") or {}).get("lora_r"))  # a LoRA run: a peft adapter folder, or merged
        if merge and not lora:
            raise ValueError(f"{ckpt} is not from a LoRA run (hf-tp train --lora-r); --merge applies to LoRA runs only")
        write = _write_adapter if lora and not merge else _write_weights
        config = write(ckpt, tmp, chosen or "fp32", max_shard_size, trust_remote_code)
        for f in (ckpt / "model_files").iterdir():  # tokenizer files and the source's generation config
            if f.is_file() and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        (tmp / "README.md").write_text(_model_card(ckpt, config, f"{chosen or 'fp32'} ({how})"))
        _write_marker(tmp, ckpt, state)
        _ordinary_permissions(tmp)  # mkdtemp makes the folder 700, safetensors its files 600
        _put_in_place(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if (error := _os_error(exc)) is not None and error is not exc:
            raise error from exc
        raise
    return Path(out_dir)


def _real(path: str | Path) -> Path:
    """``path`` absolute, with every symlink resolved: what a comparison of two paths must use."""
    return Path(os.path.realpath(Path(path).expanduser()))


def writable_target(out_dir: str | Path) -> Path:
    """``out_dir``'s real path, refused (``ValueError``) when it is a file or the folder the export
    is built in cannot be made and written there: tried, not asked (``os.access`` says yes to root
    under /proc and on read-only mounts). Cheap: run before any checkpoint is read."""
    out = _real(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export dir {out} is a file, not a folder; nothing was written: pass a folder path")
    if (reason := unwritable_reason(out.parent)) is not None:
        raise ValueError(f"export dir {out} cannot be created or written: {reason}; pass a dir you can write")
    return out


def refuse_overlap(ckpt: Path, out: Path) -> None:
    """``ValueError`` when the real path ``out`` is, holds or lies inside the checkpoint being
    exported, its run dir (``RUN`` of ``RUN/checkpoints/step-N``) or the run's checkpoints folder:
    writing there would replace what is read. Other paths in the run (``RUN/export``) are left to
    :func:`check_replaceable`, which keeps the run's own files."""
    run = root = None
    for path in (ckpt, _real(ckpt)):  # by the given path, or where a symlink leads
        if path.parent.name == "checkpoints":
            run, root = _real(path.parent.parent), _real(path.parent)
            break
    real = _real(ckpt)
    example = f", e.g. {run / 'export'}" if run else ""
    fix = f"nothing was written or deleted: pass another dir{example}"
    if run is not None and out == run:
        raise ValueError(f"export dir {out} is the run being exported; {fix}")
    if run is not None and out in run.parents:
        raise ValueError(f"export dir {out} contains the run being exported ({run}); {fix}")
    if root is not None and out == root:
        raise ValueError(f"export dir {out} is the run's checkpoints folder; {fix}")
    if root is not None and root in out.parents:
        raise ValueError(f"export dir {out} is inside the run's checkpoints folder {root}; {fix}")
    if out == real:
        raise ValueError(f"export dir {out} is the checkpoint being exported; {fix}")
    if out in real.parents:
        raise ValueError(f"export dir {out} contains the checkpoint being exported ({real}); {fix}")
    if real in out.parents:
        raise ValueError(f"export dir {out} is inside the checkpoint being exported ({real}); {fix}")


def is_export(folder: Path) -> bool:
    """Whether ``folder`` is an export of hf_tp (it holds a readable :data:`EXPORT_MARKER`)."""
    try:
        return isinstance(json.loads((folder / EXPORT_MARKER).read_text()), dict)
    except (OSError, ValueError):
        return False


def check_replaceable(out: Path, overwrite: bool) -> None:
    """``out`` may be written: it does not exist, is empty, or is an earlier export and
    ``overwrite`` is set. A folder of anything else is refused even with ``overwrite``: exports
    made before the marker existed too (nothing tells them from a user's folder)."""
    if not out.exists() or not any(out.iterdir()):
        return
    if not is_export(out):
        raise ValueError(
            f"export dir {out} is not empty and is not an hf_tp export (no {EXPORT_MARKER}; exports made before "
            "hf_tp wrote one have none); nothing was deleted: pass another dir, or empty it yourself"
        )
    if not overwrite:
        raise ValueError(
            f"export dir {out} is not empty (an earlier export); pass --overwrite to replace it, or another dir"
        )


def _write_marker(folder: Path, ckpt: Path, state: dict) -> None:
    """:data:`EXPORT_MARKER`: what was exported and when (the checkpoint's name, not this machine's
    path: a Hub push uploads the folder whole)."""
    from hf_tp import __version__

    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record = {"hf_tp": __version__, "checkpoint": ckpt.name, "step": state.get("step"), "time": stamp}
    record["files"] = sorted(p.name for p in folder.iterdir())  # its own: what --overwrite may replace
    (folder / EXPORT_MARKER).write_text(json.dumps(record, indent=1) + "\n")


def _own_entries(folder: Path, new: Path) -> set[str]:
    """What an earlier export in ``folder`` wrote itself: the names its marker lists (an export made
    before markers listed them: its weights and the names the new export ``new`` writes)."""
    try:
        files = json.loads((folder / EXPORT_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if isinstance(files, list):
        return {str(f) for f in files} | {EXPORT_MARKER}
    weights = {p.name for p in folder.glob("*.safetensors")} | {"model.safetensors.index.json"}
    return weights | {p.name for p in new.iterdir()} | {EXPORT_MARKER}


def _keep_users_entries(aside: Path, out: Path, own: set[str]) -> list[str]:
    """Move what the user added to an earlier export (``aside``, now out of the way) into the new
    one ``out``; a name the new export also writes is kept as ``NAME.before-export``. Returns the
    names kept."""
    kept = []
    for entry in sorted(aside.iterdir(), key=lambda p: p.name):
        if entry.name in own:
            continue
        target = out / entry.name
        if target.exists():
            target = out / f"{entry.name}.before-export"
        os.replace(entry, target)
        kept.append(target.name)
    return kept


def _put_in_place(tmp: Path, out: Path) -> list[str]:
    """Rename the built folder ``tmp`` to ``out``. An earlier export there is renamed aside first;
    once the new one is in place, the files the user added to it move into the new one and the rest
    (the earlier export's own files) is deleted: a crash at any point leaves the old or the new
    export whole and deletes nothing else (an empty ``out`` is replaced by the rename itself).
    Returns the names of the user's files kept."""
    if not out.exists() or not any(out.iterdir()):
        os.replace(tmp, out)
        return []
    check_replaceable(out, overwrite=True)  # again: it was empty when checked, before the export was built
    aside = Path(tempfile.mkdtemp(prefix=f".old-{out.name}-", dir=out.parent))
    try:
        os.replace(out, aside)  # onto the empty folder mkdtemp made: a name nothing else uses
    except BaseException:
        aside.rmdir()
        raise
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(aside, out)
        raise
    kept = _keep_users_entries(aside, out, _own_entries(aside, out))
    shutil.rmtree(aside, ignore_errors=True)  # the earlier export's own files only
    return kept


def _os_error(exc: BaseException) -> OSError | None:
    """``exc`` as an ``OSError``: itself, or the one safetensors wraps in its own error (a full disk
    while a shard is written); None for anything else."""
    if isinstance(exc, OSError):
        return exc
    found = re.search(r"os error (\d+)", str(exc)) if type(exc).__name__ == "SafetensorError" else None
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else None


def _write_weights(ckpt: Path, folder: Path, dtype: str, max_shard_size: str | int, trust: bool):
    """The weights (streamed) and config.json of the export into ``folder``; returns the config."""
    import torch

    from hf_tp.checkpoint.stream import write_shards
    from hf_tp.core.model_source import ModelSource

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    source = ModelSource.at(ckpt / "model_files", trust)
    config = source.config
    with torch.device("meta"):  # names, shapes, ties and weight conversions; no memory; a wrapper's own class
        model = source.build(dtype=torch.float32)
    run = load_trainer_state(ckpt).get("config") or {}
    read = None
    if run.get("lora_r"):  # merged: base weights from the run's model folder plus the adapters
        from hf_tp.checkpoint.lora_export import merged_reader

        read = merged_reader(ckpt, model, run)
    elif getattr(config, "text_config", None) is not None:  # a multimodal wrapper: its frozen vision tower
        from hf_tp.checkpoint.wrapper_export import frozen_from_source_reader

        read = frozen_from_source_reader(ckpt, model, run)
    write_shards(ckpt, model, folder, torch_dtype, max_shard_size, read)
    config = model.config
    config.dtype = torch_dtype
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    return config


def _write_adapter(ckpt: Path, folder: Path, dtype: str, max_shard_size: str | int, trust: bool):
    """The peft adapter folder of a LoRA run into ``folder``; returns the base model's config."""
    import torch

    from hf_tp.checkpoint.lora_export import write_adapter
    from hf_tp.core.model_source import ModelSource

    run = load_trainer_state(ckpt)["config"]
    write_adapter(ckpt, folder, {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype], run)
    return ModelSource.at(ckpt / "model_files", trust).config


def base_source(state: dict) -> str | None:
    """The model a run started from: hf-tp train's --model, or hf_tp.save_checkpoint's name_or_path."""
    return state.get("config", {}).get("model") or state.get("base_model")


def base_dtype(source: str | None) -> str | None:
    """The dtype (fp32, bf16 or fp16) the base model's config.json names (``dtype``, or
    ``torch_dtype`` as older releases wrote it), from a local folder or the Hub cache (never the
    network); None where no config can be read or it names none of those."""
    if not source:
        return None
    path = Path(source).expanduser()
    config: Path | None = path / "config.json" if path.is_dir() else None
    if config is None and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(source, "config.json")
        except ValueError:  # not a valid Hub id either
            cached = None
        config = Path(cached) if isinstance(cached, str) else None
    if config is None or not config.is_file():
        return None
    data = json.loads(config.read_text())
    name = str(data.get("dtype") or data.get("torch_dtype") or "").removeprefix("torch.")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name)


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
    """The README: base model, architecture, training run, dataset and the dtype written (and why)."""
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
    text = getattr(config, "text_config", None) or config  # a multimodal wrapper: its language model's sizes
    loader = (config.architectures or ["AutoModelForCausalLM"])[0] if text is not config else "AutoModelForCausalLM"
    return (
        "---\n" + "\n".join(meta) + "\n---\n\n"
        f"# {title}, trained with hf_tp\n\n"
        f"- base model: {model if base else 'not recorded'}\n"
        f"- architecture: `{config.model_type}`, {text.num_hidden_layers} layers, hidden {text.hidden_size}\n"
        + training
        + (f"- dataset: {dataset}\n" if run.get("dataset") else "")
        + f"- weights exported in {dtype} from `{ckpt.name}`\n\n"
        f"Load with `{loader}.from_pretrained` and `AutoTokenizer.from_pretrained`.\n"
    )
