"""A model that ships its own Python code runs it only with ``--trust-remote-code``: without the
flag it is refused with one line naming the flag and its code never runs; with it one warning
names the repo, the classes are registered so later loads (the adapter's plan, the ranks'
``from_pretrained``) need no flag, and a checkpoint of it carries the code an export needs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_tp.adapters import get_adapter
from hf_tp.checkpoint.checkpoint_dirs import MARKER
from hf_tp.checkpoint.hf_folder import export_checkpoint
from hf_tp.checkpoint.remote_code import copy_model_code
from hf_tp.cli.main import main
from hf_tp.core.model_source import RemoteCodeRefused, auto_config
from hf_tp.run.validate import load_model_config

CONFIGURATION = """
from pathlib import Path

from transformers import LlamaConfig

Path(__file__).with_name("RAN").touch()  # in transformers' module cache: proof that this code ran
Path({sentinel!r}).touch()


class ToyConfig(LlamaConfig):
    model_type = {model_type!r}
"""
MODELING = """
from transformers import LlamaForCausalLM

from .configuration_toy import ToyConfig


class ToyForCausalLM(LlamaForCausalLM):
    config_class = ToyConfig
"""


@pytest.fixture(autouse=True)
def modules_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers copies a repo's code into its module cache and imports it from there: a
    private cache per test (and sys.path as it was)."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))


def toy_repo(folder: Path, model_type: str, sentinel: Path) -> Path:
    """A model folder whose config.json's auto_map names its own config and causal-LM classes."""
    folder.mkdir(parents=True)
    (folder / "configuration_toy.py").write_text(CONFIGURATION.format(sentinel=str(sentinel), model_type=model_type))
    (folder / "modeling_toy.py").write_text(MODELING)
    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, max_position_embeddings=32,
    ).to_dict()  # fmt: skip
    config.update(
        model_type=model_type,
        auto_map={"AutoConfig": "configuration_toy.ToyConfig", "AutoModelForCausalLM": "modeling_toy.ToyForCausalLM"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_without_the_flag_a_model_needing_its_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    sentinel = tmp_path / "RAN"
    repo = toy_repo(tmp_path / "toy", "hf_tp_toy_refused", sentinel)
    line = (
        f"{repo} needs its own Python code to load (its config.json's auto_map names classes transformers does "
        "not have); read that code, then pass --trust-remote-code to run it"
    )
    for load in (lambda: load_model_config(str(repo)), lambda: auto_config(repo, False)):
        with pytest.raises(RemoteCodeRefused) as refused:  # hf-tp train's check before launch, the ranks' load
            load()
        assert str(refused.value) == line
    assert not sentinel.exists()


def test_with_the_flag_its_code_runs_once_warned_and_exports(tmp_path: Path, capsys) -> None:
    sentinel = tmp_path / "RAN"
    repo = toy_repo(tmp_path / "toy", "hf_tp_toy_trusted", sentinel)
    config = load_model_config(str(repo), trust_remote_code=True)
    assert type(config).__name__ == "ToyConfig" and sentinel.exists()
    assert capsys.readouterr().err == (
        f"hf-tp: warning: --trust-remote-code: running the Python code that {repo} ships (its config.json's "
        "auto_map); it runs with your permissions: use this only for a repo you trust\n"
    )
    model = AutoModelForCausalLM.from_config(config)  # registered: no flag needed by later loads
    assert type(model).__name__ == "ToyForCausalLM"
    assert get_adapter(config).model_type == "hf_tp_toy_trusted"  # the plan derived as for any model

    ckpt = tmp_path / "run" / "checkpoints" / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    model.config.save_pretrained(ckpt / "model_files")
    copy_model_code(model, ckpt / "model_files")  # what hf_tp's save adds for such a model
    assert {"configuration_toy.py", "modeling_toy.py"} <= {p.name for p in (ckpt / "model_files").iterdir()}
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "base_model": str(repo)}))
    (ckpt / MARKER).write_text("step 1\n")
    out = export_checkpoint(ckpt, tmp_path / "export", trust_remote_code=True)
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert type(exported).__name__ == "ToyForCausalLM"
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in model.state_dict().items())


def test_export_of_such_a_checkpoint_needs_the_flag(tmp_path: Path, capsys) -> None:
    repo = toy_repo(tmp_path / "toy", "hf_tp_toy_export", tmp_path / "RAN")
    ckpt = tmp_path / "step-1"
    dcp.save({"model": {"x": torch.zeros(1)}}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "model_files").mkdir()
    for name in ("config.json", "configuration_toy.py", "modeling_toy.py"):
        (ckpt / "model_files" / name).write_bytes((repo / name).read_bytes())
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1}))
    (ckpt / MARKER).write_text("step 1\n")
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--dtype", "fp32"]) == 2
    assert capsys.readouterr().err == (
        f"hf-tp export: error: {ckpt / 'model_files'} needs its own Python code to load (its config.json's "
        "auto_map names classes transformers does not have); read that code, then pass --trust-remote-code to run it\n"
    )
    assert not (tmp_path / "RAN").exists() and not (tmp_path / "out").exists()
