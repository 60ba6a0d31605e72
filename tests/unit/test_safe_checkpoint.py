"""A checkpoint someone else made cannot run code. A crafted ``.metadata`` (``os.system``,
``exec``, a payload inside genuine DCP metadata) or optimizer value is refused with one line by
``--resume``'s checks and load, ``hf-tp export``, the Python API, the LoRA and streaming readers,
and its payload never runs; real checkpoints still load and export, and name only the globals the
safe reader allows."""

from __future__ import annotations

import importlib
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM

import hf_tp
from hf_tp.checkpoint.dcp import _train_state, load_checkpoint, save_checkpoint
from hf_tp.checkpoint.integrity import newest_good_checkpoint, write_manifest
from hf_tp.checkpoint.lora_export import read_lora_tensors
from hf_tp.checkpoint.safe_load import ALLOWED_GLOBALS, UnsafeCheckpoint, is_allowed, read_safe_metadata
from hf_tp.checkpoint.stream import write_shards
from hf_tp.cli.main import main
from hf_tp.run.config import TrainConfig
from hf_tp.run.validate import check_resume_before_launch
from tests.unit.test_export_stream import fake_checkpoint

FIX = "delete it, or move it out of the run, and use a checkpoint you made"


class Payload:
    """Pickles as the call ``func(*args)``: what a hostile pickle holds."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def globals_of(path: Path) -> set[tuple[str, str]]:
    """Every global the pickle in ``path`` names (loaded by the plain unpickler: trusted files only)."""
    found: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as f:
        Recording(f).load()
    return found


def hostile_metadata(genuine: Path, sentinel: Path) -> dict[str, bytes]:
    """The global each refusal must name -> a ``.metadata`` whose unpickling creates ``sentinel``."""
    metadata = read_safe_metadata(genuine)
    metadata.planner_data = Payload(open, str(sentinel), "w")  # after every allowed global of real metadata
    return {
        "os.system": b"cos\nsystem\n(V" + f"touch {sentinel}".encode() + b"\ntR.",
        "builtins.exec": pickle.dumps(Payload(exec, f"open({str(sentinel)!r}, 'w').close()")),
        f"{open.__module__}.open": pickle.dumps(metadata),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    """A run dir with one checkpoint written by hf_tp's own save (a world of one, gloo): model and
    AdamW state, whose ``param_groups`` DCP stores as pickled bytes."""
    assert not dist.is_initialized(), "an earlier test left its process group behind"
    root = tmp_path_factory.mktemp("saved")
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    save_checkpoint(root / "run", 1, model, opt, {"base_dtype": "fp32"}, [])
    yield root / "run", model, opt
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    return AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip


def test_real_checkpoints_name_only_allowed_globals_and_still_load(saved, tiny_llama, tmp_path: Path) -> None:
    run, model, opt = saved
    ckpt = run / "checkpoints" / "step-1"
    exported, _ = fake_checkpoint(tmp_path / "fake", tiny_llama)
    named = globals_of(ckpt / ".metadata") | globals_of(exported / ".metadata")
    assert [g for g in sorted(named) if not is_allowed(*g)] == []
    core = "torch.distributed.checkpoint"
    assert {(f"{core}.metadata", "Metadata"), (f"{core}.filesystem", "_StorageInfo"), ("torch", "float32")} <= named
    for module, name in ALLOWED_GLOBALS:  # each still exists in this torch / Python
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"

    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.param_groups[0]["lr"] = 5.0
    load_checkpoint(ckpt, model, opt)  # the load --resume runs, optimizer values included
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    out = hf_tp.export(exported, tmp_path / "export")
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("kind", ["os.system", "builtins.exec", f"{open.__module__}.open"])
def test_a_crafted_metadata_is_refused_with_one_line_and_runs_nothing(
    kind: str, saved, tiny_llama, tmp_path: Path, capsys
) -> None:
    src, model, opt = saved
    run = tmp_path / "run"
    shutil.copytree(src, run)
    ckpt = run / "checkpoints" / "step-1"
    sentinel = tmp_path / "PWNED"
    (ckpt / ".metadata").write_bytes(hostile_metadata(src / "checkpoints/step-1/.metadata", sentinel)[kind])
    write_manifest(ckpt)  # its sizes made to match, as whoever planted it would
    line = (
        f"checkpoint {ckpt / '.metadata'} refers to {kind}, which a DCP checkpoint never holds: refusing to load "
        f"it (it could run code); {FIX}"
    )
    said: list[str] = []
    with pytest.raises(UnsafeCheckpoint) as refused:  # the ranks' choice of checkpoint
        newest_good_checkpoint(run, said.append)
    assert str(refused.value) == line and said == []  # not "damaged": no quiet fallback to an older one
    for load in (
        lambda: check_resume_before_launch(TrainConfig(output_dir=str(run), resume=True), None),  # hf-tp train
        lambda: load_checkpoint(ckpt, model, opt),  # the ranks' resume load
        lambda: hf_tp.export(ckpt, tmp_path / "api"),  # the Python API
        lambda: read_lora_tensors(ckpt),  # a LoRA run's adapter export
        lambda: write_shards(ckpt, meta_model(tiny_llama), tmp_path / "shards", torch.float32, "1GB"),
    ):
        with pytest.raises(UnsafeCheckpoint) as refused:
            load()
        assert str(refused.value) == line
    capsys.readouterr()
    for source in (run, ckpt):
        assert main(["export", str(source), str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"hf-tp export: error: {line}\n"
    assert not sentinel.exists() and not (tmp_path / "out").exists()


def meta_model(config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_a_payload_in_an_optimizer_value_is_refused_and_runs_nothing(saved, tmp_path: Path) -> None:
    _, model, opt = saved
    ckpt = tmp_path / "step-1"
    state = _train_state(model, opt)
    sentinel, control = tmp_path / "PWNED", tmp_path / "RAN"
    state["optim"]["param_groups"][0]["lr"] = Payload(open, str(sentinel), "w")
    dcp.save(state, checkpoint_id=str(ckpt))
    with pytest.raises(UnsafeCheckpoint) as refused:
        load_checkpoint(ckpt, model, opt)
    assert str(refused.value) == (
        f"checkpoint {ckpt}: the saved value of optim.param_groups.0.lr refers to {open.__module__}.open, which a "
        f"DCP checkpoint never holds: refusing to load it (it could run code); {FIX}"
    )
    assert not sentinel.exists()
    # The same file through torch's own planner runs the payload: what the safe planner is for (if
    # a torch release stops running it, the planner may go).
    state["optim"]["param_groups"][0]["lr"] = Payload(open, str(control), "w")
    dcp.save(state, checkpoint_id=str(tmp_path / "control"))
    dcp.load(_train_state(model, opt), checkpoint_id=str(tmp_path / "control"))
    assert control.exists() and not sentinel.exists()
