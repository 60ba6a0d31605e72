"""Read a DCP checkpoint without running code stored in it.

torch's ``FileSystemReader.read_metadata`` unpickles the checkpoint's ``.metadata`` file, and its
``DefaultLoadPlanner.load_bytes`` reads the non-tensor values (the optimizer's ``param_groups``)
with ``torch.load(weights_only=False)``: a checkpoint someone else made could run any code on
``--resume``, ``hf-tp export`` or ``hf_tp.export``. Here ``.metadata`` is read by an unpickler that
knows only the classes DCP writes there (:data:`ALLOWED_GLOBALS`), and the byte values with
torch's weights-only unpickler; anything else is refused with one line (:class:`UnsafeCheckpoint`)
before it is built. Tensors DCP already reads with ``weights_only=True``; ``rng.pt`` is read that
way too and ``trainer_state.json`` is JSON.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from hf_tp.compat.torch_distributed import metadata_path, set_element

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Every global a DCP ``.metadata`` refers to (pickletools.dis of a tp2 x dp2 hf_tp checkpoint with
# optimizer state), plus plain containers older pickle protocols name. Calling any of them builds
# data, never runs code.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "_MEM_FORMAT_ENCODING",  # TensorProperties' memory format, an Enum
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # file, offset, length of each item
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # torch.strided by name, from torch's own table
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)
# torch.float32 and the other dtypes pickle as ("torch", name): allowed by value, not by a list.
_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))
FIX = "delete it, or move it out of the run, and use a checkpoint you made"


def is_allowed(module: str, name: str) -> bool:
    """Whether the DCP metadata reader builds the global ``module.name``."""
    return (module, name) in ALLOWED_GLOBALS or (module == "torch" and name in _DTYPES)


class UnsafeCheckpoint(ValueError):
    """A checkpoint holds something DCP never writes and whose loading could run code."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds only :data:`ALLOWED_GLOBALS` and torch dtypes."""

    def __init__(self, file: io.BufferedIOBase, where: Path) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if is_allowed(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"checkpoint {self.where} refers to {module}.{name}, which a DCP checkpoint never holds: refusing to "
            f"load it (it could run code); {FIX}"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"checkpoint {self.where} holds a persistent reference DCP never writes; {FIX}")


def read_safe_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP metadata in file ``path``, built from DCP's own classes only. Raises
    :class:`UnsafeCheckpoint` for anything else, ``ValueError`` when it is not DCP metadata, and
    what pickle raises for a damaged file."""
    where = Path(path)
    with open(where, "rb") as f:
        metadata = _MetadataUnpickler(f, where).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{where} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with :func:`read_safe_metadata`; the metadata is read once (one
    read, however many ``dcp.load`` calls use the reader)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._metadata: dict[Any, Metadata] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._metadata = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            metadata = read_safe_metadata(metadata_path(self, rank))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata[rank] = metadata
        return self._metadata[rank]


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values read by torch's weights-only unpickler
    (plain Python data and tensors) instead of ``torch.load(weights_only=False)``."""

    def __init__(self, where: Path) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            what = f"refers to {found.group(1)}" if found else "is not plain data"
            raise UnsafeCheckpoint(
                f"checkpoint {self.where}: the saved value of {fqn} {what}, which a DCP checkpoint never holds: "
                f"refusing to load it (it could run code); {FIX}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def unsafe_cause(exc: BaseException) -> UnsafeCheckpoint | None:
    """The :class:`UnsafeCheckpoint` a (possibly nested) ``CheckpointException`` carries, or None."""
    seen = [exc]
    while seen:
        e = seen.pop()
        if isinstance(e, UnsafeCheckpoint):
            return e
        if isinstance(e, CheckpointException):  # rank -> (exception, traceback)
            seen += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    return None


def safe_load(
    state: dict[str, Any], ckpt: str | os.PathLike, *, no_dist: bool = False, reader: SafeReader | None = None
) -> None:
    """``dcp.load(state, ...)`` from checkpoint folder ``ckpt`` through :class:`SafeReader` and
    :class:`SafePlanner`. The metadata is checked first, so an unsafe one is refused with its own
    line rather than inside DCP's "metadata is None" (DCP tries other files when one fails)."""
    reader = reader if reader is not None else SafeReader(ckpt)
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=SafePlanner(Path(ckpt)), no_dist=no_dist)
    except CheckpointException as exc:
        if (unsafe := unsafe_cause(exc)) is not None:
            raise unsafe from None
        raise
