"""The pieces that let one CPU process run a rank of a large tp x dp job on fake tensors, and the
mesh it simulates (the one :func:`hf_tp.build_mesh` makes) with its process groups by name ->
(mesh dim, size), which the comm counter files each collective under.

Each piece is a context manager that undoes itself, so an estimate leaves no global state behind
and can run again in the same process.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake as is_fake_tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed import device_mesh
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hf_tp.estimate.memory import ep_groups
from hf_tp.parallel.mesh import HSDP_DIMS


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
    _clear_sharding_caches()
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_caches()


def _clear_sharding_caches() -> None:
    """Forget DTensor's cached sharding decisions between fake worlds.

    DeviceMesh equality ignores process-group names, so an output spec cached in an earlier world
    can carry that world's mesh, whose group names belong to other groups in this one (a cp sweep
    then gathered tp activations over the old cp group). A no-op if torch moves the helper.
    """
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()


@contextlib.contextmanager
def real_device_meshes() -> Iterator[None]:
    """Build DeviceMeshes from real tensors even inside FakeTensorMode.

    ``fully_shard`` on TP parameters builds a (dp, tp) DeviceMesh, whose ``__init__`` reads its
    rank tensor (``aten.nonzero``), which fake tensors cannot answer; expert parallelism reads a
    mesh's ranks (``DeviceMesh.mesh``, rebuilt with ``as_strided`` on each access) and builds its
    mesh with ``init_device_mesh`` (whose rank tensor would be fake).
    """
    original = DeviceMesh.__init__
    mesh_property = DeviceMesh.__dict__["mesh"]  # the rank tensor, rebuilt from the layout on access

    def init(self, *args, **kwargs) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    def rank_tensor(self) -> torch.Tensor:
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

    # Only the first argument (the padding mask) is read: the rest pass through as given, since
    # their number changed across releases (5.9 has no q_offset; later releases add it).
    def ignore(padding_mask, *args, **kwargs) -> bool:
        if padding_mask is not None and is_fake_tensor(padding_mask):
            padding_mask = None  # the estimate's masks are all ones
        return original(padding_mask, *args, **kwargs)

    masking_utils._ignore_causal_mask_sdpa = ignore
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


@contextlib.contextmanager
def fake_grouped_mm_any_dtype() -> Iterator[None]:
    """Let transformers' ``grouped_mm`` experts run on fake fp32 tensors.

    torch's meta kernel of ``grouped_mm`` accepts bf16 only, while real CPU and GPU kernels also
    take fp32. For fake tensors of another dtype, transformers' own fallback op (a loop of
    matmuls, with a registered fake kernel) runs instead: same output and saved tensors.
    """
    from transformers.integrations import moe

    original = moe._can_use_grouped_mm

    def can_use(input, weight, offs) -> bool:
        if is_fake_tensor(weight) and weight.dtype != torch.bfloat16:
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextlib.contextmanager
def fake_trunc_normal() -> Iterator[None]:
    """Truncated-normal initialization without its data-dependent resampling check, which fake
    tensors cannot answer (a vision tower's ``lecun_normal_``, e.g. SigLIP's): the values of a
    fake tensor do not matter, only its shape and dtype."""
    original = torch.nn.init._no_grad_trunc_normal_  # private: torch's trunc_normal_ calls it by name

    def clamped(tensor, mean, std, a, b, generator=None):
        with torch.no_grad():
            return tensor.normal_(mean, std, generator=generator).clamp_(a, b)

    torch.nn.init._no_grad_trunc_normal_ = clamped
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = original


@contextlib.contextmanager
def simulation(world_size: int) -> Iterator[None]:
    """Everything an estimate needs around its fake-tensor run; all undone on exit."""
    with (
        fake_world(world_size),
        fake_grouped_mm_any_dtype(),
        real_device_meshes(),
        separate_sharding_fake_mode(),
        unmasked_causal_attention(),
        quiet_redistribute_warning(),
        fake_trunc_normal(),
    ):
        yield


def expert_groups(experts, groups: dict[str, tuple[str, int]]) -> dict[tuple[str, str], tuple[str, int]]:
    """Add the ep mesh's groups to ``groups`` (its tp dim is the tp ranks again) and return the
    all-to-alls to count as ep, named so even where the ep ranks are all the dp ranks (one group)."""
    all_to_all = {}
    for name, dim in ep_groups(experts).items():
        groups.setdefault(name, dim)
        if dim[0] == "ep":
            all_to_all[(name, "all_to_all")] = dim
    return all_to_all


def functional_groups(mesh: DeviceMesh, cp: int) -> dict[str, tuple[str, int]]:
    """The cp group for the comm counter's functional collectives: cp's K/V gathers are functional,
    FSDP2's over dp x cp are c10d ones, and at dp = 1 the two share one process group."""
    return {mesh["cp"].get_group().group_name: ("cp", cp)} if cp > 1 else {}


def mesh_and_groups(tp: int, cp: int, dp: int, dp_replicate: int) -> tuple[DeviceMesh, dict[str, tuple[str, int]]]:
    """:func:`_layout_mesh` and, as "world", the group of the gradient norm's one all-reduce over
    every rank (:func:`hf_tp.parallel.grad.clip_grad_norm`)."""
    mesh, groups = _layout_mesh(tp, cp, dp, dp_replicate)
    groups.setdefault(dist.group.WORLD.group_name, ("world", dist.get_world_size()))
    return mesh, groups


def _layout_mesh(tp: int, cp: int, dp: int, dp_replicate: int) -> tuple[DeviceMesh, dict[str, tuple[str, int]]]:
    """The mesh hf_tp.build_mesh makes, and its groups by name -> (dim, size) for the comm counter
    (sliced outside fake mode). With cp, FSDP2 runs on dp x cp: its traffic is counted as "dp".
    With HSDP, FSDP2's gathers and reduce-scatters over the shard group count as "dp", its
    gradient all-reduce across replicas as "dp_replicate", and collectives over all dp ranks
    (e.g. a router's gradient kept whole) as "dp_all"."""
    if dp_replicate > 1:
        mesh = init_device_mesh("cpu", (dp_replicate, dp // dp_replicate, tp), mesh_dim_names=HSDP_DIMS)
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        named = {"tp": "tp", "dp_shard": "dp", "dp_replicate": "dp_replicate"}
        groups = {mesh[d].get_group().group_name: (name, mesh[d].size()) for d, name in named.items()}
        groups.setdefault(flat.get_group().group_name, ("dp_all", flat.size()))
        return mesh, groups
    if cp == 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        return mesh, {mesh[d].get_group().group_name: (d, mesh[d].size()) for d in ("dp", "tp")}
    mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    groups = {mesh[d].get_group().group_name: (d, mesh[d].size()) for d in ("cp", "tp")}
    groups[flat.get_group().group_name] = ("dp", flat.size())
    return mesh, groups


# Ops whose output size depends on the data, under the estimate's fake tensors.
#
# A fake tensor has no values, so ``nonzero`` (Qwen4-Exp's sparse-attention indexer lists the keys a
# query may see with it) cannot know how many elements it returns; torch's fake mode refuses it.
# The estimate takes such an op at its upper bound, every element selected (for the indexer: every
# visible key), so the step runs with the largest tensors the op can produce: memory and work are
# never under-counted for it.
aten = torch.ops.aten


class DataDependentBounds(TorchDispatchMode):
    """Run (innermost, just above the fake mode) ``nonzero`` as its upper bound: the indices of
    every element, an uninitialized ``[numel, dim]`` long tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower to local ops first
        if func is aten.nonzero.default:
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return func(*args, **(kwargs or {}))
