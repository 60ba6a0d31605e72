"""What DPO's reference model adds to a training step's estimate (``hf-tp estimate --objective dpo``).

``hf-tp train --objective dpo`` without ``--lora-r`` builds the reference as a frozen copy of the
checkpoint, sharded exactly like the policy (the same plan on the same mesh, FSDP2 over dp, fp32
shards) but without gradients or optimizer state, and runs it once per micro-batch, without
autograd, after the policy's forward (whose saved activations are then alive). So it adds:

- its weights: the policy's parameter shards once more, held for the whole run;
- its forward: simulated here as the rest of the estimate is (fake tensors, a fake process
  group, the real parallelized model and log-prob code), no-grad: one decoder layer gathered and
  computed at a time. The step's peak is then the larger of the policy's own peak and the moment
  of the reference forward (the policy's state and saved activations, plus that forward's peak);
- compute: one more forward, about a third of a training step (2N of 6N FLOPs per token).

With ``--lora-r`` the reference is the policy with its adapters off (no second copy: no memory,
the forward's time only); ``--precompute-ref`` scores the pairs once before training (the copy
is freed after it: no memory and no time per step); SimPO has no reference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import PretrainedConfig

from hf_tp.estimate.api import Estimate, MemoryBreakdown, MiB
from hf_tp.estimate.memory import PeakMemTracker
from hf_tp.estimate.simulate import mesh_and_groups, simulation
from hf_tp.estimate.step import make_batch, model_from_config, text_vocab_size
from hf_tp.parallel.logps import sequence_log_probs
from hf_tp.train.loss import loss_context


@dataclass(frozen=True)
class ReferenceCost:
    """Per rank: the reference's ``kind``, its ``weights`` (bytes held through the run), its
    no-grad forward's peak (``forward``, bytes beyond the weights), the step's ``peak`` and
    between-steps ``state`` totals with it, and its forward's compute as a fraction of a step."""

    objective: str
    kind: str  # "frozen copy", "adapters off", "precomputed", "none"
    weights: int = 0
    forward: int = 0
    peak: int = 0
    state: int = 0
    compute: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """What the report says of it."""
        head = f"{self.objective.upper()} reference: {self.kind}"
        if self.kind != "frozen copy":
            extra = {
                "adapters off": "the policy's own weights (no copy, no memory); one no-grad forward per micro-batch "
                "(+1/3 of a step's compute)",
                "precomputed": "scored once before training (the frozen copy freed after it): nothing per step",
                "none": "SimPO needs none",
            }[self.kind]
            return [f"{head}: {extra}"]
        return [
            f"{head}: weights {self.weights / MiB:,.1f} MiB per rank (sharded like the policy, no gradients or "
            f"optimizer state), its no-grad forward {self.forward / MiB:,.1f} MiB at its peak",
            f"  with it: peak {self.peak / MiB:,.1f} MiB, after step {self.state / MiB:,.1f} MiB per rank; "
            "+1/3 of a step's compute (one more forward)",
        ]


def reference_cost(est: Estimate, config: PretrainedConfig, objective: str, precompute: bool = False) -> ReferenceCost:
    """What ``objective``'s reference adds to ``est`` (a step on the pairs' 2 x pairs rows)."""
    if objective != "dpo":
        return ReferenceCost(objective, "none", peak=est.peak.total, state=est.state.total)
    if precompute:
        return ReferenceCost(objective, "precomputed", peak=est.peak.total, state=est.state.total)
    if est.lora_r:
        return ReferenceCost(objective, "adapters off", peak=est.peak.total, state=est.state.total, compute=1 / 3)
    weights = est.state.parameters  # the policy's parameter shards: the copy is built and sharded alike
    forward = _no_grad_forward_peak(est, config) - weights
    during = est.state.total + est.peak.activations + weights + forward
    peak = max(est.peak.total + weights, during)
    return ReferenceCost(objective, "frozen copy", weights, forward, peak, est.state.total + weights, 1 / 3)


def _no_grad_forward_peak(est: Estimate, config: PretrainedConfig) -> int:
    """Bytes one rank holds at the peak of the frozen copy's log-prob forward (its shards included)."""
    with simulation(est.world_size):
        mesh, _ = mesh_and_groups(est.tp, est.cp, est.dp, est.dp_replicate)
        fake = FakeTensorMode()
        with fake:
            frozen = est.spec.replace(activation_checkpointing=False, lora_r=0)  # a no-grad copy of the base
            model = model_from_config(config, mesh, frozen).requires_grad_(False).eval()
            batch = make_batch(text_vocab_size(config), est.batch_size, est.seq_len)
        tracker = PeakMemTracker()
        tracker.track_external(model)
        with fake, tracker, torch.no_grad(), loss_context(True):
            sequence_log_probs(model, batch)
        return MemoryBreakdown.from_snapshot(tracker.get_tracker_snapshot("peak")).total
