"""Shared test helpers: tiny models of real config classes, a threaded process group, parity."""

from __future__ import annotations

import copy
import queue
import threading
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from hf_tp.verify.compare import full, full_grads, full_params  # noqa: F401 - shared with the tests

# fp32 parity: the standard of the project. Not to be loosened to make a test pass.
RTOL = 1e-5
ATOL = 1e-6


def parity_dtype(family: str) -> torch.dtype:
    """fp32, except for Gemma: it multiplies the embeddings by sqrt(hidden) (8 here), so its
    embedding gradient is ~8x larger than any other tensor's while its round-off stays at fp32's
    ~1e-6 of its size, above the element-wise ATOL floor. Gemma's parity runs in float64, where
    the same tolerances are many orders of magnitude stricter."""
    return torch.float64 if family.startswith("gemma") else torch.float32


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# Every Gemma 2/3 feature on: logit soft-capping (Gemma 2), alternating sliding-window and global
# layers (window 5 < the test sequences), query_pre_attn_scalar != head_dim.
_GEMMA_2_3 = dict(
    head_dim="hidden/heads",
    sliding_window=5,
    query_pre_attn_scalar=12,
    layer_types=["sliding_attention", "full_attention"],
)
# model_type -> what its tiny model sets beyond the common sizes ("hidden/heads": head_dim is a config
# field of its own in these families, 128 by default, not hidden / heads).
FAMILY_SETTINGS: dict[str, dict] = {
    "llama": dict(attention_bias=True, mlp_bias=True, rope_parameters=_LLAMA3_ROPE),
    "qwen2": {},
    "mistral": dict(sliding_window=5),
    "qwen3": dict(head_dim="hidden/heads", attention_bias=True),
    "gemma": dict(head_dim="hidden/heads"),
    "gemma2": _GEMMA_2_3,
    "gemma3_text": _GEMMA_2_3,
}

FAMILIES = tuple(FAMILY_SETTINGS)


def tiny_config(family: str, *, tied: bool = False, heads: int = 4, kv_heads: int = 2, **overrides) -> PretrainedConfig:
    """A small but real config of ``family`` (a ``model_type``) from its own config class; vocab
    1001 is not divisible by any tp > 1 on purpose."""
    common = dict(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        # HF's default 0.02 leaves a 64-wide model's attention nearly uniform, so some weight
        # gradients (layer 1's k_proj: ~1e-9 against ~1e-3 elsewhere) sit at fp32 round-off, and
        # AdamW's sign-like first update turns that round-off into weight differences: a parity
        # check of them would test noise. At 0.1 every gradient is resolved.
        initializer_range=0.1,
    )
    if family not in FAMILY_SETTINGS:
        raise ValueError(f"no tiny settings for {family!r}; add it to FAMILY_SETTINGS")
    common.update(FAMILY_SETTINGS[family])
    if common.get("head_dim") == "hidden/heads":
        common["head_dim"] = common["hidden_size"] // heads
    common.update(overrides)
    return AutoConfig.for_model(family, **common)


def tiny_model(
    config: PretrainedConfig, attn: str = "sdpa", seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    torch.manual_seed(seed)
    if config.model_type == "gemma2":
        attn = "eager"  # transformers has no sdpa path for Gemma 2 (its attention logits are soft-capped)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    # HF initialises with std 0.02 and zero biases; random biases and norm weights make the test
    # see them (a bias that was not sharded with its weight would otherwise go unnoticed).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                norm = name.endswith("norm.weight") or p.shape[0] == config.hidden_size
                p.normal_(1.0 if norm else 0.0, 0.1)
    return model


def batch(vocab: int, b: int = 2, s: int = 13, pad: str | None = "right", seed: int = 1) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels (-100 on padding); the rows have different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if pad is not None:
        for row in range(1, b):
            n = min(s - 2, 3 * row)
            if pad == "right":
                mask[row, s - n :] = 0
            else:
                mask[row, :n] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _World:
    """``size`` rank threads, each holding its rank of one threaded process group, kept from one
    :func:`run_threaded` call to the next while calls succeed.

    Why kept: DTensor caches each sharding decision per thread, so a fresh thread per call redid
    every one of them through a new FakeTensorMode (about half of the grids' time). Why the process
    group too: those caches hand back the mesh of the first call that asked (meshes compare equal
    by ranks, shape and thread), so a later call's mesh must live in the same world, as a real
    process's ranks do for the whole run (hf_tp keeps one expert-parallel mesh per world).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        store = dist.HashStore()
        self.jobs = [queue.SimpleQueue() for _ in range(size)]
        self.threads = [
            threading.Thread(target=self._serve, args=(r, store), daemon=True, name=f"hf_tp-test-rank-{r}-of-{size}")
            for r in range(size)
        ]
        for t in self.threads:
            t.start()

    def _serve(self, rank: int, store: dist.Store) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=self.size, store=store)
        try:
            while True:
                job, done = self.jobs[rank].get()
                if job is None:
                    return
                try:
                    job()
                finally:
                    done.set()
        finally:
            dist.destroy_process_group()

    def close(self, timeout: float = 10.0) -> None:
        """End each rank's loop and process group (a rank still stuck in a call is left behind)."""
        for jobs in self.jobs:
            jobs.put((None, None))
        for t in self.threads:
            t.join(timeout)


_WORLDS: dict[int, _World] = {}


def run_threaded(world_size: int, fn: Callable[[int], None], timeout: float = 300.0) -> None:
    """Run ``fn(rank)`` on ``world_size`` threads, each a rank of torch's in-process process group.

    Hand-written because torch ships this only inside ``MultiThreadedTestCase`` (unittest-style,
    one class per world size, a new world per test); a function keeps pytest parametrization and
    lets the reference model be built once in the main thread (threads share the CPU RNG). The
    ranks and their process group serve later calls of the same size (:class:`_World`); a call
    in which a rank fails ends them, so a failure never leaks into the next test.
    """
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    errors: dict[int, str] = {}

    def job(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported below with the rank
            errors[rank] = traceback.format_exc()
            ProcessLocalGroup.exception_handle(exc)

    done = [threading.Event() for _ in range(world_size)]
    world = _WORLDS.get(world_size)
    try:
        if world is None:
            world = _WORLDS[world_size] = _World(world_size)
        for rank in range(world_size):
            world.jobs[rank].put((lambda r=rank: job(r), done[rank]))
        for event in done:
            if not event.wait(timeout):
                errors.setdefault(-1, f"a rank did not finish within {timeout}s")
    finally:
        ProcessLocalGroup.reset()
        if errors and world is not None:
            del _WORLDS[world_size]
            world.close()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        # the rank that failed first, not one released from a collective by that failure
        causes = [r for r, text in errors.items() if "Test termination event occurs" not in text] or list(errors)
        rank = min(causes)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")


class _Float64Islands(TorchFunctionMode):
    """Every fp32 cast and fp32 dtype argument made float64 (``x.float()``, ``x.to(torch.float32)``,
    ``softmax(dtype=torch.float32)``, ``torch.zeros(..., dtype=torch.float32)``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def has_fp32_islands(model: torch.nn.Module) -> bool:
    """True if a float64 build of ``model`` kept fp32 parameters: transformers wrote parts of it to
    compute in fp32 (hyper-connection mixers, routers, norms), whose round-off would sit in its gradients."""
    return any(p.dtype == torch.float32 for p in model.parameters())


_EXACT = threading.local()  # the mode a thread's outermost running module entered, and that module


def _enter_float64(module: torch.nn.Module, args) -> None:
    if getattr(_EXACT, "owner", None) is None:
        _EXACT.mode, _EXACT.owner = _Float64Islands(), module
        _EXACT.mode.__enter__()


def _exit_float64(module: torch.nn.Module, args, output) -> None:
    if getattr(_EXACT, "owner", None) is module:
        mode, _EXACT.mode, _EXACT.owner = _EXACT.mode, None, None
        mode.__exit__(None, None, None)


def float64_everywhere(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a float64 model with fp32 islands) computing wholly in float64: its fp32
    parameters cast, and every forward of one of its modules, the outermost one running, in a mode
    that turns each fp32 cast or dtype argument into float64 (a module hook, so it holds in every
    rank thread, in generate, and in activation checkpointing's recompute during backward).

    What the float64 grid needs where transformers wrote parts of a model to compute in fp32: there
    both the reference and hf_tp carry fp32 round-off (about 1e-7 of a value, more in a sum over
    every token) that a tolerance must either admit, hiding a bug of that size, or fail on. With
    the islands in float64, both runs agree to float64 round-off. Hooks travel with deep copies."""
    model.double()
    for module in model.modules():
        module.register_forward_pre_hook(_enter_float64)
        module.register_forward_hook(_exit_float64, always_call=True)
    return model


def assert_close_dict(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, **tol) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got.keys() ^ want.keys())}"
    for name in want:
        torch.testing.assert_close(
            got[name],
            want[name],
            rtol=tol.get("rtol", RTOL),
            atol=tol.get("atol", ATOL),
            msg=lambda m, n=name: f"{what} {n}: {m}",
        )


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def offline_datasets(tmp_path, monkeypatch) -> None:
    """No Hub requests (a missing id fails at once instead of retrying) and no writes to ~/.cache."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")
    datasets.disable_progress_bars()


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives dispatched in this thread, by op name (``all_gather_into_tensor``,
    ``reduce_scatter_tensor``, ``all_reduce``, ``allreduce_``, ...).

    Not torch's ``CommDebugMode``: its module tracker registers a forward hook on every module it
    sees, keyed by name, and transformers >= 5.25 calls functions such as
    ``apply_rotary_pos_emb`` through one module shared by every layer and model (the ``kernels``
    package's function modules): the hooks pile up on it, outlive the mode and fail every later
    forward in the process (``IndexError: pop from empty list``); threaded ranks race on them too."""

    SKIP = ("wait_tensor", "_wrap_tensor_autograd")

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):  # DTensor dispatches first: its collectives then pass here
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace in ("_c10d_functional", "c10d") and name not in self.SKIP:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def get_comm_counts(self) -> dict[str, int]:
        return dict(self.counts)

    def get_total_counts(self) -> int:
        return sum(self.counts.values())
