"""Before launch: is ``--model`` a complete, readable model folder? (The files behind a
:class:`hf_tp.core.model_source.ModelSource`'s weights.)

``hf-tp train`` reads a local folder's ``config.json``, its weights and its tokenizer on every rank.
A folder that lacks one of them (or holds a truncated download) would start all ranks and fail in each
with a traceback; :func:`check_model_source` says what is missing in one line first. It reads file
names, small JSON files and each safetensors file's header (never a tensor), so it costs milliseconds.

Hub ids are left to loading (the files may still be downloaded), except with ``HF_HUB_OFFLINE=1``:
then the ranks can only use the Hub cache, and its snapshot is checked like a local folder.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

# transformers' names (transformers.utils.SAFE_WEIGHTS_NAME, ...; a test keeps them equal), spelled
# out here so that this check does not import transformers (3 s).
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
CONFIG_NAME = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Files a tokenizer can be built from without tokenizer.json (the vocab_files_names of transformers'
# tokenizers: sentencepiece models, BPE vocab + merges, WordPiece vocab, tiktoken, Mistral's tekken).
VOCAB_NAMES = frozenset({"vocab.json", "merges.txt", "vocab.txt", "bpe.codes", "tekken.json"})
VOCAB_SUFFIXES = (".model", ".tiktoken")
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers
_COPY_AGAIN = "copy or download it again"


class _Problem(Exception):
    """What is wrong with a folder (``what``) and how to fix it (``fix``); ``missing``: files are absent
    (the Hub cache's fix is then a download), not damaged."""

    def __init__(self, what: str, fix: str, missing: bool = False) -> None:
        super().__init__(what)
        self.what, self.fix, self.missing = what, fix, missing


def looks_local(model: str) -> bool:
    """True if ``model`` can only be a path: absolute, starting with ``.`` or ``~``, or not of a Hub
    id's form (``owner/name`` or ``name``: at most one ``/``, no spaces, ...)."""
    if os.path.isabs(model) or model.startswith((".", "~")) or (os.sep != "/" and os.sep in model):
        return True
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return True
    return False


def check_model_source(model: str) -> None:
    """Raise ValueError (one line: what is missing or damaged, and the fix) unless ``model`` is a
    loadable model folder: config.json (valid JSON), weights (model.safetensors, a sharded
    model.safetensors.index.json with every shard it names, pytorch_model.bin or its index, each
    safetensors header readable and the file exactly as long as it says) and tokenizer files.

    A path that does not exist is "model not found"; a Hub id is checked only with
    ``HF_HUB_OFFLINE=1`` (its cached snapshot), else left to loading."""
    path = Path(model).expanduser()
    if path.is_dir():
        _raise_for(path, f"model folder '{model}'", None)
        return
    if path.exists():
        raise ValueError(
            f"model not found: '{model}' is a file; pass the model's folder (config.json, weights, tokenizer files)"
        )
    if looks_local(model):
        raise ValueError(f"model not found: no file or directory at '{model}'")
    snapshot = _offline_snapshot(model)
    if snapshot is not None:
        _raise_for(snapshot, f"the Hub cache's copy of '{model}' ({snapshot})", model)


def _raise_for(folder: Path, label: str, hub_id: str | None) -> None:
    try:
        _check_folder(folder)
    except OSError as exc:  # permissions, I/O errors: one line, not a traceback
        raise ValueError(f"{label} cannot be read ({exc}); check its files and permissions") from None
    except _Problem as p:
        fix = p.fix
        if hub_id is not None:  # offline: the ranks cannot download what the cache lacks
            fix = (
                "unset HF_HUB_OFFLINE so that it is downloaded"
                if p.missing
                else f"delete the Hub cache's copy (hf cache delete) and download '{hub_id}' again"
            )
        raise ValueError(f"{label} {p.what}; {fix}") from None


def _offline_snapshot(model: str) -> Path | None:
    """The cached snapshot folder of Hub id ``model`` when HF_HUB_OFFLINE=1 and its config.json is
    cached; else None (online, the ranks download what the cache lacks)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        return None
    try:
        cached = try_to_load_from_cache(model, CONFIG_NAME)
    except ValueError:  # not a valid repo id: loading says so
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def _check_folder(folder: Path) -> None:
    config = _read_json(
        folder, CONFIG_NAME, "pass a folder written by save_pretrained (config.json, weights, tokenizer)"
    )
    _check_weights(folder, config)
    _check_tokenizer(folder)


def _read_json(folder: Path, name: str, fix_missing: str) -> dict:
    """``folder/name`` parsed (a JSON object), or a _Problem naming it."""
    path = folder / name
    if not path.is_file():
        raise _Problem(f"has no {name}", fix_missing, missing=True)
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Problem(f"has a damaged {name} (not valid JSON: {exc})", _COPY_AGAIN) from None
    except OSError as exc:
        raise _Problem(f"has an unreadable {name} ({exc.strerror or exc})", "check its permissions") from None
    if not isinstance(data, dict):
        raise _Problem(f"has a damaged {name} (a JSON {type(data).__name__}, not an object)", _COPY_AGAIN)
    return data


def _check_weights(folder: Path, config: dict) -> None:
    """The weight files from_pretrained would read (transformers' order), or for hf_tp's sharded
    reader any ``*.safetensors``; every top-level safetensors file's header (hf_tp opens them all)."""
    explicit = config.get("transformers_weights")  # a config may name its weights file (transformers 5)
    safetensors = sorted(folder.glob("*.safetensors"))
    if isinstance(explicit, str) and explicit:
        if not (folder / explicit).is_file():
            raise _Problem(
                f"has no {explicit} (the weights file its config.json names in transformers_weights)",
                "copy the weight files into it",
                missing=True,
            )
        files = _index_shards(folder, explicit) if explicit.endswith(".index.json") else [folder / explicit]
    elif (folder / SAFE_WEIGHTS_NAME).is_file():
        files = [folder / SAFE_WEIGHTS_NAME]
    elif (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():
        files = _index_shards(folder, SAFE_WEIGHTS_INDEX_NAME)
    elif (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif (folder / WEIGHTS_INDEX_NAME).is_file():
        files = _index_shards(folder, WEIGHTS_INDEX_NAME)
    elif safetensors:  # other names (a variant, unindexed shards): hf_tp's sharded reader reads them all
        files = safetensors
    else:
        raise _Problem(
            f"has no weights (no {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, {WEIGHTS_NAME} or "
            f"{WEIGHTS_INDEX_NAME})",
            "copy the weight files into it (save_pretrained writes them)",
            missing=True,
        )
    if (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():  # hf_tp reads its weight_map whichever file loads
        _index_shards(folder, SAFE_WEIGHTS_INDEX_NAME, need_all=False)
    for f in dict.fromkeys([*safetensors, *files]):
        if f.suffix == ".safetensors":
            _check_safetensors(f, folder)
        else:
            _check_bin(f, folder)


def _index_shards(folder: Path, index_name: str, need_all: bool = True) -> list[Path]:
    """The shard files an index's weight_map names (all present, unless ``need_all`` is False)."""
    index = _read_json(folder, index_name, "copy the weight files into it")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise _Problem(f"has a damaged {index_name} (no weight_map of tensor names to shard files)", _COPY_AGAIN)
    shards = list(dict.fromkeys(weight_map.values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing and need_all:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise _Problem(
            f"lacks {len(missing)} of the {len(shards)} weight shards that {index_name} names: {shown}",
            "copy the missing shard files into it",
            missing=True,
        )
    return [folder / s for s in shards]


def _check_safetensors(path: Path, folder: Path) -> None:
    """The 8-byte header length, the JSON header, and a file size equal to the end of the last
    tensor the header names (safetensors' own rule); then ``safe_open`` (header only, memory-mapped)."""
    name = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)
    if not path.is_file():  # a link to nothing (a Hub cache snapshot links its files to blobs)
        raise _Problem(f"has a broken link: {name} points to no file", _COPY_AGAIN, missing=True)
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise _Problem(f"has damaged weights: {name} is truncated ({size} bytes, not even a header)", _COPY_AGAIN)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise _Problem(
                f"has damaged weights: {name} has a damaged header (its first 8 bytes give a {n}-byte header)",
                _COPY_AGAIN,
            )
        if 8 + n > size:
            raise _Problem(
                f"has damaged weights: {name} is truncated ({size} bytes; its header alone needs {8 + n})", _COPY_AGAIN
            )
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Problem(
            f"has damaged weights: {name} has a damaged header (not valid JSON: {exc})", _COPY_AGAIN
        ) from None
    if not isinstance(header, dict):
        raise _Problem(f"has damaged weights: {name} has a damaged header (not a JSON object)", _COPY_AGAIN)
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise _Problem(
                f"has damaged weights: {name} has a damaged header (tensor '{key}' has no data_offsets)", _COPY_AGAIN
            )
        end = max(end, offsets[1])
    expected = 8 + n + end
    if size < expected:
        raise _Problem(f"has damaged weights: {name} is truncated ({size} of {expected} bytes)", _COPY_AGAIN)
    if size > expected:
        raise _Problem(
            f"has damaged weights: {name} is longer than its header says ({size} bytes, not {expected})", _COPY_AGAIN
        )
    from safetensors import SafetensorError, safe_open  # dtypes, shapes vs offsets: what loading checks

    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except SafetensorError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _Problem(f"has damaged weights: {name} cannot be read ({first})", _COPY_AGAIN) from None


def _check_bin(path: Path, folder: Path) -> None:
    """A torch.save file: not empty; a zip archive (torch >= 1.6) must end in its central directory."""
    name = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)
    with path.open("rb") as fh:
        magic = fh.read(4)
    if not magic:
        raise _Problem(f"has damaged weights: {name} is empty", _COPY_AGAIN)
    if magic == b"PK\x03\x04" and not zipfile.is_zipfile(path):
        raise _Problem(f"has damaged weights: {name} is truncated (an incomplete zip archive)", _COPY_AGAIN)


def _check_tokenizer(folder: Path) -> None:
    """tokenizer.json, or a vocabulary a tokenizer is built from; the JSON files parse."""
    names = {p.name for p in folder.iterdir() if p.is_file()}
    has_vocab = any(n in VOCAB_NAMES or n.endswith(VOCAB_SUFFIXES) for n in names)
    if TOKENIZER_FILE not in names and not has_vocab:
        raise _Problem(
            f"has no tokenizer files ({TOKENIZER_FILE}, or a vocabulary such as tokenizer.model or "
            "vocab.json + merges.txt)",
            "copy the tokenizer's files into it (tokenizer.save_pretrained writes them)",
            missing=True,
        )
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        if name in names:
            _read_json(folder, name, "")
