"""torch's fake tensors and dispatch modes, and the patches ``hf-tp estimate`` runs its step under.

The estimate runs a training step on fake tensors in a fake process group (:mod:`hf_tp.estimate.simulate`);
what it needs of torch's private fake-tensor, dispatch and DTensor internals is here, each patch
undone on exit. ``TorchDispatchMode`` (a base class) is imported on first use:
``from hf_tp.compat.torch_fake import TorchDispatchMode``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from hf_tp.compat.reaches import reaches

FAKE = "torch._subclasses.fake_tensor"


@reaches(f"{FAKE}:unset_fake_temporarily")
def unset_fake_temporarily() -> contextlib.AbstractContextManager:
    """A context in which tensors are real again, also inside an active ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily as unset

    return unset()


@reaches(f"{FAKE}:is_fake")
def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (or a tensor subclass wrapping one)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(tensor)


@reaches(f"{FAKE}:FakeTensorMode")
def fake_tensor_mode() -> contextlib.AbstractContextManager:
    """A new ``FakeTensorMode``: tensors made inside it have shapes and dtypes, no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


@reaches("torch._guards:active_fake_mode")
def active_fake_mode() -> Any:
    """The fake mode active now, or None."""
    from torch._guards import active_fake_mode as active

    return active()


@reaches("torch.utils._pytree:tree_flatten")
def tree_leaves(obj: Any) -> list:
    """The leaves of a nested structure of lists, tuples and dicts (torch's pytree)."""
    from torch.utils._pytree import tree_flatten

    return tree_flatten(obj)[0]


@reaches("torch.utils._python_dispatch:TorchDispatchMode")
def dispatch_mode_class() -> type:
    """torch's ``TorchDispatchMode``, the base class of a mode that sees every op (``__torch_dispatch__``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def __getattr__(name: str) -> Any:
    """``TorchDispatchMode``, imported when first asked for (:func:`dispatch_mode_class`)."""
    if name == "TorchDispatchMode":
        return dispatch_mode_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@reaches("torch.testing._internal.distributed.fake_pg:FakeStore")
def fake_store() -> Any:
    """A store for ``init_process_group("fake", ...)`` (importing it registers the "fake" backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@reaches("torch.distributed.tensor.debug:_clear_sharding_prop_cache")
def clear_sharding_prop_cache() -> None:
    """Forget DTensor's cached sharding decisions (between fake worlds). A no-op if torch moves
    the helper."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()


@reaches("torch.distributed.tensor._sharding_prop:detect_fake_mode")
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


def _mesh_property() -> str | None:
    """A probe: ``DeviceMesh.mesh`` is a property of the class itself (:func:`real_device_meshes` swaps it)."""
    from torch.distributed.device_mesh import DeviceMesh

    return (
        None if isinstance(DeviceMesh.__dict__.get("mesh"), property) else "DeviceMesh.mesh is no property of its own"
    )


@reaches("torch.distributed.device_mesh:DeviceMesh.mesh", check=_mesh_property)
@reaches(f"{FAKE}:unset_fake_temporarily")
@contextlib.contextmanager
def real_device_meshes() -> Iterator[None]:
    """Build DeviceMeshes from real tensors even inside FakeTensorMode.

    ``fully_shard`` on TP parameters builds a (dp, tp) DeviceMesh, whose ``__init__`` reads its
    rank tensor (``aten.nonzero``), which fake tensors cannot answer; expert parallelism reads a
    mesh's ranks (``DeviceMesh.mesh``, rebuilt with ``as_strided`` on each access) and builds its
    mesh with ``init_device_mesh`` (whose rank tensor would be fake).
    """
    from torch.distributed import device_mesh
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__
    mesh_property = DeviceMesh.__dict__["mesh"]  # the rank tensor, rebuilt from the layout on access

    def init(self, *args, **kwargs) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    def rank_tensor(self):
        with unset_fake_temporarily():
            return mesh_property.fget(self)

    def init_mesh(*args, **kwargs) -> DeviceMesh:
        with unset_fake_temporarily():
            return build(*args, **kwargs)

    build = device_mesh.init_device_mesh
    DeviceMesh.__init__ = init
    DeviceMesh.mesh = property(rank_tensor)
    device_mesh.init_device_mesh = init_mesh
    try:
        yield
    finally:
        DeviceMesh.__init__ = original
        DeviceMesh.mesh = mesh_property
        device_mesh.init_device_mesh = build


@reaches("torch.distributed.tensor._redistribute")
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


@reaches("torch.nn.init:_no_grad_trunc_normal_")
@contextlib.contextmanager
def fake_trunc_normal() -> Iterator[None]:
    """Truncated-normal initialization without its data-dependent resampling check, which fake
    tensors cannot answer (a vision tower's ``lecun_normal_``, e.g. SigLIP's): the values of a
    fake tensor do not matter, only its shape and dtype."""
    import torch

    original = torch.nn.init._no_grad_trunc_normal_  # private: torch's trunc_normal_ calls it by name

    def clamped(tensor, mean, std, a, b, generator=None):
        with torch.no_grad():
            return tensor.normal_(mean, std, generator=generator).clamp_(a, b)

    torch.nn.init._no_grad_trunc_normal_ = clamped
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = original
