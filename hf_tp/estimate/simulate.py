"""The pieces that let one CPU process run a rank of a large tp x dp job on fake tensors.

Each is a context manager that undoes itself, so an estimate leaves no global state behind and
can run again in the same process.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake as is_fake_tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks, this process as rank 0; destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ValueError(
            "an estimate runs its own fake process group; call it outside an initialised process group "
            "(before dist.init_process_group or after dist.destroy_process_group)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def real_device_meshes() -> Iterator[None]:
    """Build DeviceMeshes from real tensors even inside FakeTensorMode.

    ``fully_shard`` on TP parameters builds a (dp, tp) DeviceMesh, whose ``__init__`` reads its
    rank tensor (``aten.nonzero``), which fake tensors cannot answer.
    """
    original = DeviceMesh.__init__

    def init(self, *args, **kwargs) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def separate_sharding_fake_mode() -> Iterator[None]:
    """Make DTensor's shape propagation use its own FakeTensorMode, not the estimate's.

    DTensor computes each op's output metadata by running the op on *global*-shape fake tensors
    in the active fake mode. MemTracker skips ops from a fake mode other than the one it was
    entered in; with the estimate's own mode reused, those global-shape tensors (e.g. a full-vocab
    fp32 log_softmax) would be counted as this rank's memory. A no-op if torch moves the hook.
    """
    from torch.distributed.tensor import _sharding_prop

    original = getattr(_sharding_prop, "detect_fake_mode", None)
    if original is None:
        yield
        return
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def quiet_redistribute_warning() -> Iterator[None]:
    """Clipping's norm over (dp, tp) makes DTensor warn about two sequential all-reduces; the
    training loop does the same, and the warning only clutters the estimate's output."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def unmasked_causal_attention() -> Iterator[None]:
    """Let HF use plain causal attention for the fake all-ones mask, as it does for a real one.

    HF drops an all-ones 2-D mask after reading its values (sdpa then runs with ``is_causal`` and
    grouped KV heads). Fake tensors have no values, so HF would instead build a (batch, 1, seq,
    seq) mask and repeat the KV heads, memory a real run does not use.
    """
    from transformers import masking_utils

    original = masking_utils._ignore_causal_mask_sdpa

    def ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None) -> bool:
        if padding_mask is not None and is_fake_tensor(padding_mask):
            padding_mask = None  # the estimate's masks are all ones
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    masking_utils._ignore_causal_mask_sdpa = ignore
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


@contextlib.contextmanager
def simulation(world_size: int) -> Iterator[None]:
    """Everything an estimate needs around its fake-tensor run; all undone on exit."""
    with (
        fake_world(world_size),
        real_device_meshes(),
        separate_sharding_fake_mode(),
        unmasked_causal_attention(),
        quiet_redistribute_warning(),
    ):
        yield
