"""``hf_tp.ParallelDims`` (hf_tp/core/dims.py): the layout's sizes declared once, checked, counted,
built into one mesh whose named slices are read once, and taken by parallelize and plan_for."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch

import hf_tp
from hf_tp.core.dims import SCHEDULE_NAMES, ParallelDims, check_dims
from hf_tp.core.mesh import MeshSlices
from tests.helpers import run_threaded, tiny_config, tiny_model

PACKAGE = Path(hf_tp.__file__).parent
DIM_FLAGS = ("--tp", "--dp", "--ep", "--cp", "--dp-replicate", "--pp", "--pp-schedule", "--microbatches")
TOOLS = ("train", "plan", "estimate", "verify", "cli")
# File names several modules of hf_tp/ share: the package files only (issue 52).
SHARED_NAMES = {"__init__.py", "__main__.py"}


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_each_dim_flag_and_field_is_declared_once_in_hf_tp() -> None:
    """No parser declares --tp (or another layout flag) by hand, and one class declares the tp
    setting: every command's flag is generated from ParallelDims' field."""
    by_hand, declared = [], []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags = {a.value for a in node.args if isinstance(a, ast.Constant)}
                by_hand += [f"{path.name}: {f}" for f in flags & set(DIM_FLAGS)]
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "tp":
                if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "setting":
                    declared.append(path.relative_to(PACKAGE).as_posix())
    assert by_hand == []
    assert declared == ["core/dims.py"]


def test_layout_names_at_most_one_class_and_no_module_name_is_shared_anew() -> None:
    layouts = [
        p.name for p, tree in _trees() for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Layout"
    ]
    assert len(layouts) <= 1, layouts
    names = Counter(p.name for p in PACKAGE.rglob("*.py"))
    assert {n for n, k in names.items() if k > 1} <= SHARED_NAMES


def test_core_imports_no_tool() -> None:
    for path in sorted((PACKAGE / "core").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                bad = [n for n in names if n.split(".")[:2] in (["hf_tp", t] for t in TOOLS)]
                assert not bad, f"{path.name} imports {bad}"


def test_the_checks_name_the_sizes_as_the_caller_wrote_them() -> None:
    with pytest.raises(ValueError, match=r"^ep must divide dp \(3\): .* got ep=2$"):
        ParallelDims(dp=3, ep=2)
    with pytest.raises(ValueError, match=r"^tp must be a positive integer, got tp=None$"):
        ParallelDims(tp=None)
    flags = dataclasses.make_dataclass("Flags", [(f.name, object) for f in dataclasses.fields(ParallelDims)])
    given = flags(**{**dataclasses.asdict(ParallelDims()), "dp": 4, "dp_replicate": 3})
    with pytest.raises(ValueError, match=r"^--dp-replicate must divide --dp \(4\): .* got 3$"):
        check_dims(given, flags=True)
    with pytest.raises(ValueError, match="pipeline settings: set pp > 1"):
        ParallelDims(pp_schedule="gpipe")
    with pytest.raises(ValueError, match="--pp 4: 4 stages but the model has 2 decoder layers"):
        check_dims(ParallelDims(pp=4), layers=2)


def test_world_rows_and_micro_batches() -> None:
    dims = ParallelDims(tp=2, dp=4, cp=2, pp=2)
    assert (dims.world_size, dims.row_multiple, dims.pipeline_microbatches) == (32, 8, 2)
    cfg = hf_tp.TrainConfig(tp=2, dp=3, cp=2, pp=3, microbatches=6)
    assert cfg.dims == ParallelDims(tp=2, dp=3, cp=2, pp=3, microbatches=6)
    assert (cfg.world_size, cfg.row_multiple) == (cfg.dims.world_size, cfg.dims.row_multiple)
    assert hf_tp.TrainConfig().dims == ParallelDims()  # tp, dp unset: 1


def _parser(module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p


def test_every_command_takes_the_fields_help_with_its_own_default_explained() -> None:
    from hf_tp.cli import estimate, plan, train, verify

    help_of = {f.name: f.metadata["flags"].help for f in dataclasses.fields(ParallelDims)}
    tp = {}
    for module in (estimate, plan, train, verify):
        action = next(a for a in _parser(module)._actions if "--tp" in a.option_strings)
        assert action.help.startswith(help_of["tp"]) and action.type is int
        tp[module.__name__.rsplit(".", 1)[1]] = (action.default, action.help[len(help_of["tp"]) :])
    assert tp["estimate"] == (1, " (default 1)")
    assert tp["train"] == (None, " (default 1; 2 for the embedded default)")  # a YAML file may set it
    for command in ("plan", "verify"):
        assert tp[command][0] == 2 and tp[command][1].startswith(" (default 2 here: ")
    schedule = next(a for a in _parser(estimate)._actions if "--pp-schedule" in a.option_strings)
    assert tuple(schedule.choices) == SCHEDULE_NAMES


def test_plan_for_takes_the_dims() -> None:
    config = tiny_config("llama")
    want = hf_tp.plan_for(config, tp=2, cp=2, seq_len=16)
    assert hf_tp.plan_for(config, ParallelDims(tp=2, cp=2), seq_len=16) == want
    with pytest.raises(ValueError, match="plan_for takes ep and cp once"):
        hf_tp.plan_for(config, ParallelDims(tp=2), cp=2)


def test_parallelize_builds_the_mesh_of_the_dims() -> None:
    """``parallelize(model, ParallelDims(...))`` is plain HF (fp32 logits), over its mesh."""
    config = tiny_config("llama")
    plain = tiny_model(config)
    models = [tiny_model(config) for _ in range(2)]
    for m in models:
        m.load_state_dict(plain.state_dict())
    ids = torch.randint(3, config.vocab_size, (2, 8))
    want = plain(ids, use_cache=False).logits

    def rank_fn(rank: int) -> None:
        with pytest.raises(ValueError, match="disagree"):
            hf_tp.parallelize(models[rank], ParallelDims(tp=2), ep=2)
        model = hf_tp.parallelize(models[rank], ParallelDims(tp=2), loss_parallel=False)
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
        assert hf_tp.record_of(model).meshes["tp"].size() == 2

    run_threaded(2, rank_fn)
    with pytest.raises(ValueError, match=r"one pipeline stage's mesh, got ParallelDims\(pp=2\)"):
        hf_tp.parallelize(tiny_model(config), ParallelDims(pp=2))


def test_the_named_slices_are_read_off_one_mesh() -> None:
    def rank_fn(rank: int) -> None:
        cp = MeshSlices.of(ParallelDims(dp=2, cp=2).build_mesh("cpu"))
        assert (cp.tp.size(), cp.dp.size(), cp.cp.size(), cp.fsdp, cp.dp_replicate) == (1, 4, 2, None, 1)
        assert cp.rows.mesh_dim_names == ("dp",) and cp.rows.size() == 2  # the rows: dp without cp
        hsdp = MeshSlices.of(ParallelDims(dp=4, dp_replicate=2).build_mesh("cpu"))
        assert hsdp.rows.size() == 4
        assert (hsdp.dp.size(), hsdp.cp, hsdp.fsdp.mesh_dim_names, hsdp.dp_replicate) == (
            4,
            None,
            ("dp_replicate", "dp_shard"),
            2,
        )

    run_threaded(4, rank_fn)
