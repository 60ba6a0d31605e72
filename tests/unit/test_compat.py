"""The release range: pyproject's floors are hf_tp/compat/releases.py's (what CI's compat run proves), a
release below a floor stops ``hf-tp`` with one line, and a family the installed transformers cannot
serve is refused naming the release it needs, before any model is built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from transformers import AutoConfig

import hf_tp
from hf_tp import compat
from hf_tp.cli.main import main
from hf_tp.compat import releases

ROOT = Path(__file__).resolve().parents[2]


def _floors(requirements: list[str]) -> dict[str, str]:
    out = {}
    for line in requirements:
        req = Requirement(line)
        for spec in req.specifier:
            if spec.operator == ">=":
                out[req.name] = spec.version
    return out


def test_pyproject_floors_are_the_tested_ones() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = _floors(project["dependencies"])
    assert {k: floors[k] for k in compat.FLOORS} == compat.FLOORS
    assert _floors(project["optional-dependencies"]["lora"])["peft"] == compat.PEFT_FLOOR
    assert _floors(project["optional-dependencies"]["test"])["peft"] == compat.PEFT_FLOOR


def test_the_installed_releases_meet_the_floors() -> None:
    assert compat.below_floor() == []
    compat.check_releases()


def _installed_as(monkeypatch, **found: str) -> None:
    real = releases.installed
    monkeypatch.setattr(releases, "installed", lambda package: found.get(package) or real(package))


def test_a_release_below_the_floor_stops_hf_tp_with_one_line(monkeypatch, capsys) -> None:
    _installed_as(monkeypatch, transformers="5.9.0", torch="2.12.0+cu126")
    assert main(["estimate", "--model", "llama-3.2-1b", "--tp", "2", "--dp", "1", "--seq-len", "16"]) == 2
    lines = capsys.readouterr().err.splitlines()
    floor = compat.FLOORS["transformers"]
    assert lines == [
        f"hf-tp: hf_tp needs torch >= {compat.FLOORS['torch']}; found 2.12.0+cu126: "
        f"pip install -U 'torch>={compat.FLOORS['torch']}'",
        f"hf-tp: hf_tp needs transformers >= {floor}; found 5.9.0: pip install -U 'transformers>={floor}'",
    ]
    with pytest.raises(compat.UnsupportedRelease, match=re.escape(f"transformers >= {floor}; found 5.9.0")):
        compat.check_releases()


def test_a_release_below_the_floor_stops_parallelize_with_one_line(monkeypatch) -> None:
    from tests.helpers import tiny_config, tiny_model

    _installed_as(monkeypatch, accelerate="1.9.0")
    floor = compat.FLOORS["accelerate"]
    want = f"hf_tp needs accelerate >= {floor}; found 1.9.0: pip install -U 'accelerate>={floor}'"
    with pytest.raises(compat.UnsupportedRelease, match=re.escape(want)):
        hf_tp.parallelize(tiny_model(tiny_config("llama")), mesh=None)  # before the mesh is read


def test_a_local_tag_does_not_count_as_older(monkeypatch) -> None:
    _installed_as(monkeypatch, torch=f"{compat.FLOORS['torch']}+cpu")
    assert compat.below_floor() == []


def test_a_family_is_refused_naming_the_release_it_needs(monkeypatch) -> None:
    config = AutoConfig.for_model("granitemoe")
    _installed_as(monkeypatch, transformers="5.20.1")
    want = (
        "granitemoe needs transformers >= 5.21.0 for a tensor-parallel plan; found 5.20.1: "
        "pip install -U 'transformers>=5.21.0'"
    )
    assert compat.family_refusal("granitemoe") == want
    with pytest.raises(compat.UnsupportedRelease) as exc:
        hf_tp.get_adapter(config)  # before any model is built (the generic plan builds one on meta)
    assert str(exc.value) == want
    _installed_as(monkeypatch, transformers="5.21.0")
    assert compat.family_refusal("granitemoe") is None and compat.family_refusal("llama") is None


def test_every_family_release_is_within_reach() -> None:
    # Each names a published release above the floor (else the family would need no entry).
    for model_type, (release, what) in compat.FAMILY_RELEASES.items():
        assert releases._base(release) > releases._base(compat.FLOORS["transformers"]), model_type
        assert what.startswith("a tensor-parallel plan"), model_type
