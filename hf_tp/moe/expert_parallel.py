"""Expert parallelism: whole experts placed on ranks, tokens moved to them with all-to-all.

EP borrows its ranks from data parallelism (dp x cp with context parallelism), as torchtitan
does: with ``dp = dp_out * ep`` each
group of ``ep`` consecutive dp ranks (same tp rank) splits a MoE layer's experts ``ep`` ways, so
the world stays ``tp * dp``. Expert weights become DTensors on a ``("dp_out", "ep", "tp")`` mesh:
``Shard(0)`` over ep (each rank its ``experts / ep``), their tp split as before (expert tensor
parallelism composes: a rank holds its tp slice of its own experts). With ``dp_out`` > 1,
:func:`hf_tp.parallel.fsdp.shard_experts_over_dp` makes each experts module an FSDP2 unit sharded
over ``dp_out`` (weights, gradients and AdamW state: 1/dp of the experts per rank whatever ep is;
gathered for the experts' forward and backward inside the dp_out group). At ep = dp they stay
outside FSDP2 and a gradient hook here averages them over dp. Either way a gradient is the sum
over every rank's tokens divided by dp, as FSDP2 averages the other weights.

Per MoE layer and micro-batch, after the router (which every rank runs on its own tokens):
1. each (token, choice) pair is sent to the ep rank that owns its expert: one variable-size
   all-to-all of the hidden rows (``all_to_all_single`` with the per-rank counts, exchanged first;
   counts are uneven and may be zero: nothing is dropped, there is no capacity limit);
2. the rank runs transformers' own experts forward (eager, ``grouped_mm`` ...) on the rows it
   received, for its local experts, with routing weight 1;
3. a second all-to-all returns the rows; the routing weights multiply them on the rank that owns
   the token (so the router's gradient stays local), and ``index_add_`` sums each token's choices.
Both all-to-alls are differentiable (``all_to_all_single_autograd``): backward sends the
gradients the opposite way.

:mod:`hf_tp.moe.routing` sizes the all-to-alls: from the router's choices (every real run),
or, installed by ``hf-tp estimate`` on the experts it simulates, as if routing were even (fake
tensors have no values to count).
"""

from __future__ import annotations

import inspect
import threading
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import device_mesh
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hf_tp.compat.torch_distributed import all_to_all_autograd, default_group, wait_tensor
from hf_tp.compat.torch_internals import own_attribute, parameter_slots, pop_own_attribute, set_own_attribute
from hf_tp.core.dims import check_expert_ranks
from hf_tp.core.mesh import pp_size
from hf_tp.core.record import ExpertShard, facts, facts_of, record_of
from hf_tp.moe.expert_lora import adopt_param_wrappers, peft_base, with_lora
from hf_tp.moe.expert_styles import region_view
from hf_tp.moe.routing import MEASURED


def build_ep_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The ``("dp_out", "ep", "tp")`` mesh over the same ranks as the ``("dp", "tp")`` ``mesh``.

    With context parallelism (a ``("dp", "cp", "tp")`` mesh) ep borrows from dp x cp: the cp ranks
    of a row hold distinct tokens, as dp ranks do, and FSDP2 averages over both (the loss's backward
    scales by cp, :mod:`hf_tp.context.token_share`), so an ep group may span them alike. A pipeline
    stage's mesh (the rest of a ``("pp", ...)`` mesh): the ep groups are that stage's ranks."""
    names = mesh.mesh_dim_names or ()
    cp = mesh["cp"].size() if "cp" in names else 1
    dp, tp = (1, mesh.size()) if mesh.ndim == 1 else (mesh["dp"].size() * cp, mesh["tp"].size())
    check_expert_ranks(dp // cp, cp, ep)
    ranks = mesh.mesh.tolist()  # (tolist, not tensor ops: also answers inside hf-tp estimate's fake mode)
    for _ in range(mesh.ndim - 1):
        ranks = [r for row in ranks for r in row]
    pp = pp_size(mesh)  # a pipeline stage's mesh: its ranks are the world's pp-th block
    if ranks != list(range(ranks[0], ranks[0] + len(ranks))) or len(ranks) * pp != dist.get_world_size():
        raise ValueError("expert parallelism needs the mesh hf_tp.build_mesh makes (ranks in order, tp adjacent)")
    # One mesh object per world and shape: DTensor's sharding propagation caches output specs by
    # mesh equality, so a second model's expert weights may come back on the first model's (equal)
    # mesh, and FSDP2's SPMD path then refuses a mesh that is not the very object it was given.
    world = default_group()
    key = (threading.get_ident(), mesh.device_type, pp, dp // ep, ep, tp)  # (threaded test worlds: a mesh per thread)
    cached = _EP_MESHES.get(key)
    if cached is None or cached[0] is not world:
        # looked up at call time: hf-tp estimate builds meshes from real rank tensors inside its fake mode
        names = ("dp_out", "ep", "tp")
        if pp > 1:  # every stage's ep groups at once (a mesh is built by every rank), this stage's kept
            whole = device_mesh.init_device_mesh(
                mesh.device_type, (pp, dp // ep, ep, tp), mesh_dim_names=("pp", *names)
            )
            out = whole[names]
        else:
            out = device_mesh.init_device_mesh(mesh.device_type, (dp // ep, ep, tp), mesh_dim_names=names)
        _EP_MESHES[key] = cached = (world, out)  # (the group kept alive with it: a new world is never taken for it)
    return cached[1]


_EP_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}


def check_experts(model: nn.Module, layers_path: str, paths: tuple[str, ...], ep: int) -> None:
    """The model has MoE layers and each one's expert count divides by ep (checked before
    anything is changed)."""
    found = experts_modules(model, layers_path, paths)
    if not found:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model; {type(model).__name__} has no experts")
    for path, experts in found:
        if len(inspect.signature(type(experts).forward).parameters) < 4:  # self, hidden_states, top_k_index, ...
            what = "every expert on every token (scaled by the router, as Llama 4's), not routed tokens an all-to-all"
            raise ValueError(
                f"ep={ep} cannot place the experts of {path}: {type(experts).__name__} runs {what} could move; use ep=1 (tp splits each expert)"
            )
        n = _num_experts(experts)
        if n % ep:
            raise ValueError(f"ep must divide the number of experts ({n}) of {path}, got ep={ep}")


def experts_modules(model: nn.Module, layers_path: str, paths: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The experts modules (``paths`` relative to each decoder layer) of the model's layers."""
    out = []
    for i, layer in enumerate(model.get_submodule(layers_path)):
        for rel in paths:
            try:
                out.append((f"{layers_path}.{i}.{rel}", peft_base(layer.get_submodule(rel))))
            except AttributeError:
                continue  # a dense layer
    return out


def apply_expert_parallel(
    model: nn.Module, layers_path: str, paths: tuple[str, ...], ep_mesh: DeviceMesh
) -> list[nn.Parameter]:
    """Place every experts module's weights on ``ep_mesh`` and route its calls through
    all-to-all; returns the expert parameters (for the layers' FSDP2 ``ignored_params``: with
    ``dp_out`` > 1 :func:`hf_tp.parallel.fsdp.apply_fsdp` shards them in units of their own)."""
    ep = ep_mesh["ep"].size()
    rank = ep_mesh["ep"].get_local_rank()
    dp = ep_mesh["dp_out"].size() * ep
    out_mesh = ep_mesh["dp_out"]
    tp_group = ep_mesh["tp"].get_group() if ep_mesh["tp"].size() > 1 else None
    params = []
    for path, experts in experts_modules(model, layers_path, paths):
        adopt_param_wrappers(model.get_submodule(path))  # peft's LoRA on the experts: added to the local views
        local = _num_experts(experts) // ep
        for name, param in list(experts.named_parameters(recurse=False)):
            value = param.to_local() if isinstance(param, DTensor) else param.detach()
            tp_placement = param.placements[0] if isinstance(param, DTensor) else Replicate()
            mine = value[rank * local : (rank + 1) * local].clone()  # a copy: a view would keep every expert alive
            dt = DTensor.from_local(mine, ep_mesh, [Replicate(), Shard(0), tp_placement], run_check=False)
            new = nn.Parameter(dt, param.requires_grad)
            if out_mesh.size() == 1 and new.requires_grad:  # else FSDP2 reduces it, or it is frozen (LoRA)
                new.register_hook(_average_over_dp(dp, tp_group))
            experts.register_parameter(name, new)
            params.append(new)
        shard = facts(experts).experts = ExpertShard(rank * local, local, ep_mesh)  # apply_fsdp: over dp_out
        shard.routing = MEASURED  # how the dispatch sizes its all-to-alls (hf_tp.moe.routing)
        record = record_of(model)
        if record is not None:
            record.experts[path] = shard
        experts.forward = types.MethodType(_dispatching_forward(type(experts).forward, ep_mesh["ep"], shard), experts)
    return params


def _average_over_dp(dp: int, tp_group):
    """Gradient hook at ep = dp (no dp_out replicas): the sum over every rank that sent tokens to
    these experts, divided by dp (FSDP2's average for the other weights).
    An expert bias added once to a tp-partial output (GPT-OSS's ``down_proj_bias``: each tp rank
    adds ``1/tp`` of it) has a gradient that is a partial sum over tp: summed here too (the fused
    reduction of :mod:`hf_tp.parallel.partial_grads` sums over dp as well, which ep-sharded
    experts must not be; it lets the now replicated gradient pass)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        local = grad.to_local() / dp
        placements = list(grad.placements)
        if placements[-1].is_partial():
            dist.all_reduce(local, group=tp_group)
            placements[-1] = Replicate()
        return DTensor.from_local(local, grad.device_mesh, placements, run_check=False)

    return hook


def _num_experts(experts: nn.Module) -> int:
    if getattr(facts_of(experts), "experts", None) is not None:
        raise ValueError("expert parallelism is already applied to this model")
    n = getattr(experts, "num_experts", None)
    if not isinstance(n, int):
        n = next(p for p in experts.parameters() if p.dim() >= 2).shape[0]
    return n


def _dispatching_forward(original, ep_mesh: DeviceMesh, shard: ExpertShard):
    group = ep_mesh.get_group()
    ep = ep_mesh.size()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        local = shard.local
        tokens, k = top_k_index.shape
        flat_expert = top_k_index.reshape(-1)
        flat_token = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)
        weights = top_k_weights.reshape(-1)
        routing = shard.routing
        keep = routing.kept(flat_expert, local * ep)
        if keep is not None:
            flat_expert, flat_token, weights = flat_expert[keep], flat_token[keep], weights[keep]
        dest = torch.div(flat_expert, local, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        flat_expert, flat_token, weights, dest = flat_expert[order], flat_token[order], weights[order], dest[order]
        me = dist.get_rank(group)
        send_sizes, recv_sizes = routing.sizes(dest, ep, group)
        ids = torch.empty(sum(recv_sizes), dtype=flat_expert.dtype, device=flat_expert.device)
        dist.all_to_all_single(ids, flat_expert - dest * local, recv_sizes, send_sizes, group=group)
        rows = wait_tensor(all_to_all_autograd(hidden_states[flat_token], recv_sizes, send_sizes, group))
        shard.tokens_per_expert = routing.load(ids, local)  # this rank's experts' load
        # rows that crossed the network, out and in (benchmarks and the estimate read it)
        shard.a2a_rows = (sum(send_sizes) - send_sizes[me], sum(recv_sizes) - recv_sizes[me])
        total = self.num_experts if hasattr(self, "num_experts") else None
        if total is not None:
            self.num_experts = local  # transformers' kernels size their per-expert counts by it
        # Local views of this rank's experts (a MoE region's views when tp > 1), in the compute
        # dtype, made here: after FSDP2 has unsharded them over dp_out, and so that their gradients
        # are accumulated before FSDP2's post-backward runs (it fires once the gradients of this
        # forward's inputs are computed; views made at the region's entry would come later).
        before = {n: own_attribute(self, n) for n in parameter_slots(self)}
        for name, param in parameter_slots(self).items():
            view = region_view(self, name)
            local = with_lora(self, name, param.to_local()) if view is None else view
            set_own_attribute(self, name, local.to(rows.dtype))
        try:
            out = original(self, rows, ids[:, None], torch.ones(len(ids), 1, dtype=rows.dtype, device=rows.device))
            if torch.is_grad_enabled() and not out.requires_grad and rows.requires_grad:
                out = _join_backward(out, rows, [own_attribute(self, n) for n in parameter_slots(self)])
        finally:
            if total is not None:
                self.num_experts = total
            for name, view in before.items():
                if view is None:
                    pop_own_attribute(self, name)
                else:
                    set_own_attribute(self, name, view)
        back = wait_tensor(all_to_all_autograd(out, send_sizes, recv_sizes, group))
        return _Combine.apply(back, weights, flat_token, hidden_states)

    return forward


class _Combine(torch.autograd.Function):
    """Each token's rows weighted by its routing weights and summed:
    ``zeros.index_add(0, token, rows * weights)``, keeping only ``rows`` for backward.

    Written by hand because autograd's ``index_add`` keeps its whole source (its formula reads
    only the source's shape): one more rows x hidden buffer per MoE layer than HF's own experts
    keep, which made ep 2 need more memory than ep 1 (Qwen3-30B-A3B: 6 GiB over 48 layers). The
    arithmetic, forward and backward, is the one autograd did."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, token: torch.Tensor, like: torch.Tensor):
        ctx.save_for_backward(rows, weights, token)
        ctx.dtypes = (rows.dtype, weights.dtype)
        return torch.zeros_like(like).index_add(0, token, (rows * weights[:, None]).to(like.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weights, token = ctx.saved_tensors
        picked = grad.index_select(0, token).to(torch.result_type(rows, weights))
        grad_rows = (picked * weights[:, None]).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        grad_weights = (picked * rows).sum(-1).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weights, None, None


def _join_backward(out: torch.Tensor, rows: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """``out`` tied to ``rows`` and the local expert weights with a zero: for a rank whose
    experts received no row, so transformers' kernels never touched them.

    Without it that rank's backward would skip both all-to-alls and its experts' gradient hooks
    (the collectives every other rank runs: a hang under NCCL), and its experts would get no
    gradient, where single-device HF gives them zeros (AdamW still decays the weights and moments).
    Adding ``0 * sum`` gives exactly those zeros: autograd keeps the node, and both are empty or zero.
    """
    touch = rows.sum() + sum(w.sum() for w in weights if w.requires_grad)
    return out + 0 * touch.to(out.dtype)
