"""Preference objectives against TRL: the DPO loss, its logged rewards and every gradient equal
TRL's DPOTrainer computation on the same tiny model and pairs (string and conversational rows, the
token ids included); SimPO against its formula; the sharded log-probs at tp2 x dp2 against tp1."""

from __future__ import annotations

import copy
import math

import datasets
import pytest
import torch
import torch.nn.functional as F

from hf_tp.compat import family_refusal
from hf_tp.data.collator import PadToMultipleCollator
from hf_tp.data.pairs import PairCollator
from hf_tp.data.steps import StepBatches
from hf_tp.data.tokenize import tokenize_dataset
from hf_tp.objectives.pair_losses import DPO, SimPO
from hf_tp.objectives.reference import FrozenCopy, model_inputs
from hf_tp.parallel.logps import linear_log_probs
from tests.chat_data import chat_tokenizer
from tests.helpers import ATOL, RTOL, assert_close_dict, full_grads, run_threaded, tiny_config, tiny_model


def _trl_at_least(version: str) -> bool:
    try:
        import trl
    except ImportError:
        return False
    from packaging.version import Version

    return Version(trl.__version__) >= Version(version)


# TRL 1.16's DPOTrainer is the reference; the release floors' pins (accelerate 1.10.0) resolve an
# older TRL, whose trainer differs: the comparison is skipped there, the rest of the file runs.
needs_trl = pytest.mark.skipif(
    not _trl_at_least("1.16"), reason="the TRL comparison needs trl >= 1.16 (pip install 'hf_tp[test]')"
)

USER = [
    "hi , i am ada . where should i go ?",
    "what is the weather in rome ?",
    "hi , i am bob .",
    "where should i go ?",
]
GOOD = ["go to paris .", "it is sunny in rome .", "hello bob , go to oslo .", "go to lima , eve ."]
BAD = ["go to .", "sunny .", "hello ada , go to cairo , go to delhi .", "i am dee ."]


def _rows(kind: str) -> dict[str, list]:
    if kind == "string":
        return {"prompt": [u + " " for u in USER], "chosen": GOOD, "rejected": BAD}

    def turn(role: str, text: str) -> dict[str, str]:
        return {"role": role, "content": text}

    if kind == "implicit":  # no prompt column: the shared leading turns are the prompt
        chosen = [[turn("user", u), turn("assistant", g)] for u, g in zip(USER, GOOD, strict=True)]
        rejected = [[turn("user", u), turn("assistant", b)] for u, b in zip(USER, BAD, strict=True)]
        return {"chosen": chosen, "rejected": rejected}
    return {
        "prompt": [[turn("user", u)] for u in USER],
        "chosen": [[turn("assistant", g)] for g in GOOD],
        "rejected": [[turn("assistant", b)] for b in BAD],
    }


def _models(tokenizer):
    config = tiny_config("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    ref = tiny_model(config)
    policy = copy.deepcopy(ref)
    with torch.no_grad():  # the policy has moved away from the reference: the loss is not ln 2
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return policy, ref


def _trl_step(policy, ref, tokenizer, rows, tmp_path, **kwargs):
    """TRL's loss (gradients in ``policy``), its logged metrics and its token ids."""
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows["chosen"]), report_to=[],
        use_cpu=True, bf16=False, max_length=None, **kwargs,  # fp32: TRL defaults to bf16 autocast
    )  # fmt: skip
    trainer = DPOTrainer(
        model=policy,
        ref_model=ref,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_dict(rows),
    )
    examples = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    inputs = trainer.data_collator(examples)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}
    ids = [ex["prompt_ids"] + ex["chosen_ids"] for ex in examples]
    return loss.detach(), metrics, ids, trainer.model


def _hf_tp_step(objective, policy, tokenizer, rows):
    data = tokenize_dataset(datasets.Dataset.from_dict(rows), tokenizer, seq_len=512)
    examples = [data[i] for i in range(len(data))]
    collate = PairCollator(PadToMultipleCollator(pad_token_id=tokenizer.pad_token_id))
    out = objective.micro_loss(policy, collate(examples), StepBatches(0, 0, [], num_examples=len(examples)))
    out.loss.backward()
    n = len(examples)
    return out.loss.detach(), {k: v.item() / n for k, v in out.sums.items()}, [ex["input_ids"] for ex in examples]


@needs_trl
@pytest.mark.parametrize("kind", ["string", "chat", "implicit"])
def test_dpo_equals_trl_loss_rewards_and_gradients(kind: str, tmp_path) -> None:
    tokenizer = chat_tokenizer()
    policy, ref = _models(tokenizer)
    mine, mine_ref = copy.deepcopy(policy), copy.deepcopy(ref)
    rows = _rows(kind)
    want, want_metrics, want_ids, trl_model = _trl_step(policy, ref, tokenizer, rows, tmp_path, beta=0.1)
    got, got_metrics, got_ids = _hf_tp_step(DPO(FrozenCopy(mine_ref), beta=0.1), mine, tokenizer, rows)
    assert got_ids == want_ids  # the same tokens, prompt and eos included
    assert abs(got.item() - math.log(2)) > 1e-3  # not the trivial first step
    torch.testing.assert_close(got, want.float(), rtol=RTOL, atol=0)
    assert set(got_metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        assert got_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert_close_dict(full_grads(mine), full_grads(trl_model), "DPO grad", rtol=RTOL, atol=ATOL)


def test_simpo_equals_its_formula(tmp_path) -> None:
    tokenizer = chat_tokenizer()
    policy, _ = _models(tokenizer)
    mine = copy.deepcopy(policy)
    rows = _rows("chat")
    beta, gamma = 2.0, 0.7
    got, metrics, _ = _hf_tp_step(SimPO(beta=beta, gamma=gamma), mine, tokenizer, rows)
    # The formula on plain logits: mean label log-prob of each completion, the paper's loss.
    data = tokenize_dataset(datasets.Dataset.from_dict(rows), tokenizer, seq_len=512)
    means = {}
    for side, ids_key, labels_key in (("c", "input_ids", "labels"), ("r", "rejected_input_ids", "rejected_labels")):
        means[side] = []
        for ex in data:
            ids, labels = torch.tensor([ex[ids_key]]), torch.tensor(ex[labels_key][1:])
            logp = F.log_softmax(policy(ids).logits[0, :-1].float(), -1)
            keep = labels != -100
            means[side].append(logp[keep].gather(1, labels[keep, None]).mean())
    c, r = torch.stack(means["c"]), torch.stack(means["r"])
    want = -F.logsigmoid(beta * (c - r) - gamma).mean()
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=0)
    assert metrics["rewards/margins"] == pytest.approx((beta * (c - r)).mean().item(), rel=1e-5)
    assert_close_dict(full_grads(mine), full_grads(policy), "SimPO grad", rtol=RTOL, atol=ATOL)


def _trl_cpo_simpo_step(policy, tokenizer, rows, tmp_path, beta: float, gamma: float):
    """TRL's CPO trainer with loss_type="simpo", cpo_alpha=0 (SimPO): its loss (gradients in
    ``policy``), logged metrics, and its tokenized pairs as hf_tp pair examples."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(
        output_dir=str(tmp_path / "cpo"), per_device_train_batch_size=len(rows["chosen"]), report_to=[],
        use_cpu=True, bf16=False, loss_type="simpo", cpo_alpha=0.0, beta=beta, simpo_gamma=gamma, max_length=512,
    )  # fmt: skip
    trainer = CPOTrainer(
        model=policy, args=args, processing_class=tokenizer, train_dataset=datasets.Dataset.from_dict(rows)
    )
    examples = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    loss.backward()
    stored = trainer._stored_metrics["train"]
    metrics = {k: v[-1] for k, v in stored.items() if k.startswith(("rewards/", "logps/"))}
    pairs = [
        {"input_ids": ex["chosen_input_ids"], "labels": ex["chosen_labels"],
         "rejected_input_ids": ex["rejected_input_ids"], "rejected_labels": ex["rejected_labels"]}
        for ex in examples
    ]  # fmt: skip
    return loss.detach(), metrics, pairs, trainer.model


@needs_trl
def test_simpo_equals_trl_cpo_simpo_loss_rewards_and_gradients(tmp_path) -> None:
    """SimPO against TRL 1.16's reference implementation (trl.experimental.cpo, loss_type="simpo",
    cpo_alpha=0) on the same tiny Llama and string pairs: the loss, every logged reward and mean
    log-prob, every gradient, on CPO's tokens (which it builds its own way: prompt and completion
    apart, BOS/EOS ids added), equal here to hf_tp's own tokens of the pairs."""
    tokenizer = chat_tokenizer()
    policy, _ = _models(tokenizer)
    mine = copy.deepcopy(policy)
    beta, gamma = 2.0, 0.7
    want, want_metrics, pairs, trl_model = _trl_cpo_simpo_step(
        policy, tokenizer, _rows("string"), tmp_path, beta, gamma
    )
    ours = tokenize_dataset(datasets.Dataset.from_dict(_rows("string")), tokenizer, seq_len=512)
    assert [p["input_ids"] for p in pairs] == ours["input_ids"] and [p["labels"] for p in pairs] == ours["labels"]
    collate = PairCollator(PadToMultipleCollator(pad_token_id=tokenizer.pad_token_id))
    out = SimPO(beta=beta, gamma=gamma).micro_loss(mine, collate(pairs), StepBatches(0, 0, [], num_examples=len(pairs)))
    out.loss.backward()
    assert abs(want.item() - math.log(2)) > 1e-3  # not a trivial step
    torch.testing.assert_close(out.loss.detach(), want.float(), rtol=RTOL, atol=0)
    assert set(want_metrics) == {f"rewards/{k}" for k in ("chosen", "rejected", "accuracies", "margins")} | {
        "logps/chosen",
        "logps/rejected",
    }
    for name, value in want_metrics.items():
        assert out.sums[name].item() / len(pairs) == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert_close_dict(full_grads(mine), full_grads(trl_model), "SimPO grad", rtol=RTOL, atol=ATOL)


def test_log_probs_equal_log_softmax_in_every_chunking() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 16, generator=g, requires_grad=True)
    weight = torch.randn(37, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 37, (13,), generator=g)
    targets[[0, 5]] = -100
    scale = torch.randn(13, generator=g)
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    want = F.log_softmax(h2 @ w2.t(), -1).gather(1, targets.clamp(min=0)[:, None])[:, 0] * (targets != -100)
    (want * scale).sum().backward()
    for chunk in (1, 4, 64):
        hidden.grad = weight.grad = None
        got = linear_log_probs(hidden, weight, targets, chunk_tokens=chunk)
        (got * scale).sum().backward()
        torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(hidden.grad, h2.grad, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(weight.grad, w2.grad, rtol=RTOL, atol=ATOL)


def _pair_batches(tokenizer, dp: int, rank: int, multiple_of: int = 1):
    """The whole batch of the chat pairs, and dp rank ``rank``'s half of them (a pair never split)."""
    data = tokenize_dataset(datasets.Dataset.from_dict(_rows("chat")), tokenizer, seq_len=512)
    examples = [data[i] for i in range(len(data))]
    collate = PairCollator(PadToMultipleCollator(pad_token_id=tokenizer.pad_token_id, multiple_of=multiple_of))
    per_rank = len(examples) // dp
    return collate(examples), collate(examples[rank * per_rank : (rank + 1) * per_rank]), len(examples)


@pytest.mark.parametrize(
    ("objective", "tp", "cp", "dp"),
    [("dpo", 2, 1, 2), ("dpo adapters off", 2, 1, 2), ("dpo", 2, 2, 1), ("simpo", 2, 1, 2)],
    ids=["dpo-tp2-dp2", "dpo-lora-adapters-off-tp2-dp2", "dpo-tp2-cp2", "simpo-tp2-dp2"],
)
def test_preference_loss_sharded_equals_one_process(objective: str, tp: int, cp: int, dp: int) -> None:
    """The loss and every gradient at tp2 x dp2 (FSDP2 over dp; DPO's reference a frozen copy
    sharded like the policy, or the LoRA policy with its adapters off) and at tp2 x cp2 equal one
    process's on the whole batch; the adapters-off reference equals a frozen copy of the base."""
    import hf_tp
    from hf_tp.objectives.reference import AdaptersOff
    from tests.lora_grid import lora

    tokenizer = chat_tokenizer()
    policy, ref = _models(tokenizer)
    if objective == "dpo adapters off":  # the base is the reference: a frozen copy of it must agree
        policy = lora(copy.deepcopy(ref))
    whole, _, n = _pair_batches(tokenizer, 1, 0)
    policies = [copy.deepcopy(policy) for _ in range(4)]
    refs = [copy.deepcopy(ref) for _ in range(4)]
    one = SimPO() if objective == "simpo" else DPO(FrozenCopy(copy.deepcopy(ref)))
    want = one.micro_loss(policy, whole, StepBatches(0, 0, [], num_examples=n)).loss
    want.backward()
    want_grads = full_grads(policy)

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=tp, cp=cp, dp=dp, device_type="cpu")
        model = hf_tp.parallelize(policies[rank], mesh)
        if objective == "simpo":
            sharded = SimPO()
        elif objective == "dpo adapters off":
            sharded = DPO(AdaptersOff(model))
        else:
            sharded = DPO(FrozenCopy(hf_tp.parallelize(refs[rank], mesh)))
        _, mine, _ = _pair_batches(tokenizer, dp, mesh.get_local_rank("dp"), multiple_of=tp * (2 * cp if cp > 1 else 1))
        loss = sharded.micro_loss(model, mine, StepBatches(0, 0, [], num_examples=n)).loss
        (loss * dp).backward()  # FSDP2 averages over dp; the loop's factor dp makes it the sum
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=mesh["dp"].get_group())
        torch.testing.assert_close(total, want.detach(), rtol=RTOL, atol=0)
        assert_close_dict(full_grads(model), want_grads, f"{objective} grad at tp{tp} x cp{cp} x dp{dp}")

    run_threaded(4, rank_fn)


def test_precomputed_reference_equals_the_reference_forward() -> None:
    """--precompute-ref at dp2 (5 pairs: the last round is filled): the stored log-probs give the
    loss and gradients of the frozen copy's forward."""
    import hf_tp
    from hf_tp.objectives.precompute import Stored, with_reference_logps

    tokenizer = chat_tokenizer()
    policy, ref = _models(tokenizer)
    rows = {k: v + v[:1] for k, v in _rows("chat").items()}
    data = tokenize_dataset(datasets.Dataset.from_dict(rows), tokenizer, seq_len=512)
    collate = PairCollator(PadToMultipleCollator(pad_token_id=tokenizer.pad_token_id))
    step = StepBatches(0, 0, [], num_examples=len(data))
    want = DPO(FrozenCopy(copy.deepcopy(ref))).micro_loss(policy, collate(list(data)), step).loss
    refs, stored = [copy.deepcopy(ref) for _ in range(2)], {}

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=1, dp=2, device_type="cpu")
        reference = FrozenCopy(hf_tp.parallelize(refs[rank], mesh))
        where = dict(dp_rank=rank, dp=2, group=mesh["dp"].get_group(), device=torch.device("cpu"))
        stored[rank] = with_reference_logps(data, reference, collate, batch_size=2, **where)

    run_threaded(2, rank_fn)
    assert stored[0]["ref_chosen_logps"] == stored[1]["ref_chosen_logps"] and len(stored[0]) == 5
    got = DPO(Stored()).micro_loss(copy.deepcopy(policy), collate(list(stored[0])), step).loss
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)


def test_held_out_pairs_evaluate_to_one_process_numbers() -> None:
    """The eval record at dp2 (5 pairs: one rank runs a filler) equals the objective's loss and
    metrics over the same pairs on one process."""
    import hf_tp
    from hf_tp.train.pair_evaluation import PairEvalSet

    tokenizer = chat_tokenizer()
    policy, ref = _models(tokenizer)
    rows = {k: v + v[:1] for k, v in _rows("chat").items()}
    data = tokenize_dataset(datasets.Dataset.from_dict(rows), tokenizer, seq_len=512)
    collate = PairCollator(PadToMultipleCollator(pad_token_id=tokenizer.pad_token_id))
    with torch.no_grad():
        want = DPO(FrozenCopy(copy.deepcopy(ref))).micro_loss(
            policy, collate(list(data)), StepBatches(0, 0, [], num_examples=5)
        )
    models, refs, records = [copy.deepcopy(policy) for _ in range(2)], [copy.deepcopy(ref) for _ in range(2)], {}

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=1, dp=2, device_type="cpu")
        model = hf_tp.parallelize(models[rank], mesh)
        evals = PairEvalSet(data, collate, rank, 2, 2, 4, 0, torch.device("cpu"))
        evals.bind(DPO(FrozenCopy(hf_tp.parallelize(refs[rank], mesh))), mesh["dp"].get_group())
        records[rank] = evals.record(3, model)

    run_threaded(2, rank_fn)
    assert records[0] == {**records[1], "eval_time_s": records[0]["eval_time_s"]}
    assert records[0]["eval_pairs"] == 5
    assert records[0]["eval_loss"] == pytest.approx(want.loss.item(), rel=1e-6)
    for name, value in want.sums.items():
        assert records[0][f"eval_{name}"] == pytest.approx(value.item() / 5, rel=1e-5, abs=1e-7), name


def _moe_case(aux: bool):
    """A float64 Qwen3-MoE policy moved away from its reference, and 4 pairs (one pair's rows end in
    padding, which the router aux loss leaves out) as the whole batch's rows, chosen then rejected."""
    from tests.family_grid import grid_config, grid_model

    config = grid_config("qwen3_moe", output_router_logits=aux, router_aux_loss_coef=0.5)
    ref = grid_model(config)
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(p.numel())))
    ids = torch.randint(3, config.vocab_size, (8, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[[1, 5], 9:] = 0  # pair 1: both sides padded
    labels = torch.where((torch.arange(12) < 5) | (mask == 0), -100, ids)  # the first 5 tokens: the prompt
    return policy, ref, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _padded(batch: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """The rows padded on the right to a multiple of ``multiple`` tokens, as the collator pads them."""
    extra = -batch["input_ids"].shape[1] % multiple
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: F.pad(v, (0, extra), value=fill[k]) for k, v in batch.items()}


def _pairs_of(batch: dict[str, torch.Tensor], pairs: list[int]) -> dict[str, torch.Tensor]:
    rows = pairs + [p + 4 for p in pairs]  # their chosen rows, then their rejected rows
    return {k: v[rows] for k, v in batch.items()}


@pytest.mark.skipif(bool(family_refusal("qwen3_moe")), reason=str(family_refusal("qwen3_moe")))
@pytest.mark.parametrize(
    ("tp", "dp", "ep", "cp", "aux"),
    [(2, 1, 1, 1, False), (2, 2, 1, 1, True), (1, 2, 2, 1, True), (2, 1, 1, 2, True)],
    ids=["tp2", "tp2-dp2-aux", "ep2-aux", "tp2-cp2-aux"],
)
def test_dpo_on_a_moe_equals_one_process(tp: int, dp: int, ep: int, cp: int, aux: bool) -> None:
    """Qwen3-MoE (experts split over tp, or whole over ep), DPO's loss and every gradient equal
    one process's; with output_router_logits the loss is DPO's plus router_aux_loss_coef times
    HF's own load_balancing_loss_func over the policy forward's rows (the reference adds none).
    At dp2 each rank takes two pairs in two micro-batches, the aux loss over the whole step's rows
    (the loop's step_routing), so the sum of the micro-steps' losses is the step's loss; at cp2
    each rank routes its own tokens of the rows (padded to a multiple of 2 cp tp, as the collator
    pads them) and the aux loss is summed over dp x cp."""
    import hf_tp
    from hf_tp.core.mesh import split_mesh
    from hf_tp.run.loss import step_routing

    policy, ref, batch = _moe_case(aux)
    step = StepBatches(0, 0, [], num_examples=4)
    world = tp * dp * cp
    policies, refs = [copy.deepcopy(policy) for _ in range(world)], [copy.deepcopy(ref) for _ in range(world)]
    policy.config.output_router_logits = False  # the DPO term alone, then HF's aux loss from its own forward
    want = DPO(FrozenCopy(copy.deepcopy(ref))).micro_loss(policy, batch, step).loss
    want_aux = policy(**model_inputs(batch), output_router_logits=True).aux_loss if aux else torch.zeros(())
    (want + 0.5 * want_aux).backward()
    want_grads = full_grads(policy)
    got = {}

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=tp, dp=dp, cp=cp, device_type="cpu")
        model = hf_tp.parallelize(policies[rank], mesh, ep=ep)
        group = split_mesh(mesh)[0].get_group()  # dp, or dp x cp: the ranks whose tokens differ
        objective = DPO(FrozenCopy(hf_tp.parallelize(refs[rank], mesh, ep=ep)), route_group=group)
        d = mesh.get_local_rank("dp")
        rows = _pairs_of(_padded(batch, 2 * cp * tp) if cp > 1 else batch, list(range(4)))
        micro = [_pairs_of(rows, [p]) for p in range(d * 4 // dp, (d + 1) * 4 // dp)]
        routing = step_routing(model, micro, group) if len(micro) > 1 else None
        loss, aux_sum = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for m in micro:
            out = objective.micro_loss(model, m, step, routing=routing)
            (out.loss * dp).backward()  # FSDP2 averages over dp; the loop's factor dp makes it the sum
            loss, aux_sum = loss + out.loss.detach(), aux_sum + (out.aux if out.aux is not None else 0)
        torch.distributed.all_reduce(loss, group=mesh["dp"].get_group())  # (cp ranks: each the whole rows' loss)
        torch.distributed.all_reduce(aux_sum, group=mesh["dp"].get_group())
        got[rank] = (loss.double(), aux_sum.double())
        assert_close_dict(full_grads(model), want_grads, f"DPO grad on a MoE at tp{tp} x cp{cp} x dp{dp} x ep{ep}")

    run_threaded(world, rank_fn)
    for loss, aux_sum in got.values():
        torch.testing.assert_close(loss, (want + 0.5 * want_aux).detach().double(), rtol=RTOL, atol=0)
        torch.testing.assert_close(aux_sum, want_aux.detach().double(), rtol=RTOL, atol=0)
    assert aux == (want_aux.item() > 0)


def test_a_router_aux_loss_hf_tp_cannot_add_is_refused() -> None:
    """A model asking for a router aux loss that is not transformers' load_balancing_loss_func
    (here a Llama told output_router_logits): refused in one line naming the fix, not dropped."""
    from hf_tp.parallel.logps import log_probs_refusal, sequence_log_probs

    model = tiny_model(tiny_config("llama", output_router_logits=True, router_aux_loss_coef=0.1))
    assert "set output_router_logits=False" in log_probs_refusal(model)
    assert log_probs_refusal(model, router_logits=False) is None  # a reference forward adds no aux loss
    with pytest.raises(ValueError, match="not transformers' load_balancing_loss_func"):
        sequence_log_probs(
            model,
            {"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long)},
            router_logits=True,
        )


def test_precomputed_reference_log_probs_are_kept_with_the_dataset_cache(tmp_path) -> None:
    """--precompute-ref's scores are written under the key of the reference's files, the tokenized
    pairs, --seq-len and the dtype: a second run reads them (no reference forward, the same
    numbers), a changed key scores again; the key changes with each of those and nothing else."""
    import os

    import hf_tp
    from hf_tp.objectives.precompute import with_reference_logps
    from hf_tp.objectives.ref_cache import cache_key, cache_path, cached_reference_logps, data_fingerprint

    tokenizer = chat_tokenizer()
    _, ref = _models(tokenizer)
    ref.save_pretrained(tmp_path / "ref")
    data = tokenize_dataset(datasets.Dataset.from_dict(_rows("chat")), tokenizer, seq_len=512)
    collate = PairCollator(PadToMultipleCollator(pad_token_id=tokenizer.pad_token_id))
    key = cache_key(tmp_path / "ref", data, 512, "fp32")
    assert key == cache_key(tmp_path / "ref", data, 512, "fp32")
    assert data_fingerprint(data, rows_per_read=1) == data_fingerprint(data)  # read in slices of any size
    calls, results = [], []

    def run(path) -> None:
        refs = [copy.deepcopy(ref) for _ in range(2)]

        def rank_fn(rank: int) -> None:
            mesh = hf_tp.build_mesh(tp=1, dp=2, device_type="cpu")
            reference = FrozenCopy(hf_tp.parallelize(refs[rank], mesh))
            where = dict(dp_rank=rank, dp=2, group=mesh["dp"].get_group(), device=torch.device("cpu"))

            def counted(batch):
                calls.append(rank)
                return reference(batch)

            compute = lambda: with_reference_logps(data, counted, collate, batch_size=1, **where)  # noqa: E731
            scored, computed = cached_reference_logps(data, compute, path, torch.device("cpu"))
            if rank == 0:
                results.append((scored["ref_chosen_logps"], scored["ref_rejected_logps"], computed))

        run_threaded(2, rank_fn)

    run(cache_path(key, tmp_path))
    assert results[0][2] and len(calls) == 4 and cache_path(key, tmp_path).is_file()  # 2 rounds x 2 ranks
    run(cache_path(key, tmp_path))
    assert not results[1][2] and len(calls) == 4 and results[1][:2] == results[0][:2]  # read, not scored
    run(cache_path(cache_key(tmp_path / "ref", data, 256, "fp32"), tmp_path))
    assert results[2][2] and len(calls) == 8 and results[2][:2] == results[0][:2]
    changed = {
        cache_key(tmp_path / "ref", data, 512, "bf16"),
        cache_key(tmp_path / "ref", data.select([0, 1, 2]), 512, "fp32"),
        cache_key(tmp_path / "ref", data.select([1, 0, 2, 3]), 512, "fp32"),
    }
    weights = tmp_path / "ref" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    changed.add(cache_key(tmp_path / "ref", data, 512, "fp32"))
    assert len(changed) == 4 and key not in changed
