"""The one record of what ``parallelize`` did (:mod:`hf_tp.record`) and ``hf_tp.describe``."""

from __future__ import annotations

import io

import pytest

import hf_tp
from hf_tp.record import ParallelRecord, record_of
from tests.helpers import clone, run_threaded, tiny_config, tiny_model


def hf_tp_attributes(model) -> list[str]:
    """Every ``hf_tp_*`` attribute left on a module of ``model`` (parallelize sets none)."""
    return [f"{path or '<model>'}.{k}" for path, m in model.named_modules() for k in vars(m) if k.startswith("hf_tp_")]


def test_record_of_a_tp2_dp2_model_and_describe() -> None:
    ref = tiny_model(tiny_config("llama", num_hidden_layers=2))
    models = [clone(ref) for _ in range(4)]
    seen: dict[int, tuple] = {}

    def rank_fn(rank: int) -> None:
        model = models[rank]
        assert record_of(model) is None
        hf_tp.parallelize(model, hf_tp.build_mesh(tp=2, dp=2, device_type="cpu"))
        record = record_of(model)
        assert isinstance(record, ParallelRecord) and model.hf_tp is record
        out = io.StringIO()
        text = hf_tp.describe(model, file=out)
        seen[rank] = (record, text, out.getvalue(), hf_tp_attributes(model))

    run_threaded(4, rank_fn)
    record, text, printed, left = seen[0]
    assert {d: m.size() for d, m in record.meshes.items()} == {"tp": 2, "dp": 2}
    assert record.model_type == "llama" and record.fsdp and record.layers_path == "model.layers"
    assert record.options.sequence_parallel and record.options.loss_parallel
    assert set(record.layer_plan) >= {"self_attn.q_proj", "mlp.down_proj"}
    assert record.partial_grads is not None and record.cp is None and not record.experts and record.lora is None
    assert left == []
    assert printed == text + "\n"
    lines = text.splitlines()
    assert lines[0] == "hf_tp: llama (hand-written)"
    assert lines[1] == "meshes: tp=2, dp=2 (FSDP2 over dp)"
    assert "decoder layers (model.layers): 1 kind(s)" in lines and "  layers 0-1:" in lines
    assert "    self_attn.q_proj: colwise" in lines
    assert "    mlp.down_proj: rowwise, reduce-scatter to sequence shards" in lines
    assert "partial gradients: one fused all-reduce per backward" in lines
    assert len({s[1] for s in seen.values()}) == 1  # every rank describes the same layout


def test_describe_refuses_a_plain_model_and_parallelize_refuses_twice() -> None:
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is not parallelized by hf_tp .*call hf_tp.parallelize"):
        hf_tp.describe(tiny_model(tiny_config("llama", num_hidden_layers=1)))
