"""The release range: pyproject's floors and upper bounds are hf_tp/compat/releases.py's (what CI's
compat run and the README's test command prove), so are the constraints files; a release below a
floor stops ``hf-tp`` with one line, one newer than the tested ceiling warns with one line, and a
family the installed transformers cannot serve is refused naming the release it needs, before any
model is built."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from transformers import AutoConfig

import hf_tp
from hf_tp import compat
from hf_tp.cli import plan
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


def _only_newer(monkeypatch, **found: str) -> None:
    """``found`` installed, every other package at its ceiling (``scripts/compat.sh next`` runs
    these tests past the ceilings: a really newer torch must not add its own line)."""
    _installed_as(monkeypatch, **{**releases.CEILINGS, "peft": releases.PEFT_CEILING, **found})


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


TESTED = ("torch", "transformers", "accelerate", "datasets", "peft")


def _bounds(requirements: list[str]) -> dict[str, str]:
    """package -> its ``<X.Y`` upper bound."""
    return {Requirement(r).name: s.version for r in requirements for s in Requirement(r).specifier if s.operator == "<"}


def test_pyproject_upper_bounds_are_the_next_minor_after_the_ceilings() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ceilings = {**compat.CEILINGS, "peft": compat.PEFT_CEILING}
    bounds = {**_bounds(project["dependencies"]), "peft": _bounds(project["optional-dependencies"]["lora"])["peft"]}
    assert _bounds(project["optional-dependencies"]["test"])["peft"] == bounds["peft"]
    for package, ceiling in ceilings.items():
        major, minor = compat.series(ceiling)
        assert bounds[package] == f"{major}.{minor + 1}", package


def _pins(name: str) -> dict[str, str]:
    lines = (ROOT / "configs" / "constraints" / name).read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_the_constraints_files_pin_the_floors_and_ceilings() -> None:
    assert {k: v for k, v in _pins("floor.txt").items() if k in TESTED} == {**compat.FLOORS, "peft": compat.PEFT_FLOOR}
    newest = {k: v for k, v in _pins("newest.txt").items() if k in TESTED}
    assert newest == {**compat.CEILINGS, "peft": compat.PEFT_CEILING}


@pytest.fixture
def unreported(monkeypatch):
    """No newer release reported yet, in this process or a parent."""
    monkeypatch.setattr(releases, "_REPORTED", set())
    monkeypatch.setenv(releases.REPORTED_ENV, "")  # (undone after the test, as the CLI's setting of it)
    monkeypatch.delenv(releases.REPORTED_ENV)


def test_the_installed_releases_are_not_newer_than_tested(unreported) -> None:
    assert compat.newer_than_tested(TESTED) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", compat.NewerRelease)
        compat.check_releases()
        compat.warn_newer_releases(("peft",))


def test_a_release_in_the_tested_series_is_not_newer(monkeypatch, unreported) -> None:
    _installed_as(monkeypatch, transformers="5.25.3", torch="2.13.1+cu126", accelerate="1.16.0rc1")
    assert compat.newer_than_tested() == []


def test_a_newer_release_warns_once_with_one_line(monkeypatch, unreported) -> None:
    _only_newer(monkeypatch, transformers="5.26.0")
    want = (
        "transformers 5.26.0 is newer than the newest release hf_tp is tested with (5.25); it may work: report "
        "what breaks, or pip install 'transformers<5.26'"
    )
    assert compat.newer_than_tested() == [want]
    with pytest.warns(compat.NewerRelease) as caught:
        compat.check_releases()  # a warning, not a refusal
        compat.check_releases()
    assert [str(w.message) for w in caught] == [want]


def test_peft_newer_than_tested_warns_only_where_lora_is_used(monkeypatch, unreported) -> None:
    _only_newer(monkeypatch, peft="0.23.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", compat.NewerRelease)
        compat.check_releases()  # start-up: peft is optional
    with pytest.warns(compat.NewerRelease, match=r"^peft 0\.23\.1 is newer .* \(0\.22\); .*'peft<0\.23'$"):
        compat.warn_newer_releases(("peft",))


def test_hf_tp_prints_a_newer_release_once_and_runs(monkeypatch, capsys, unreported) -> None:
    _only_newer(monkeypatch, torch="2.14.0", accelerate="1.17.2")
    ran = []
    monkeypatch.setattr(plan, "run", lambda args: ran.append(args.command) or 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", compat.NewerRelease)
        assert main(["plan", "--model", "llama-3.2-1b", "--tp", "2"]) == 0
        compat.check_releases()  # parallelize inside the run: reported already, no second line
    assert ran == ["plan"]
    assert capsys.readouterr().err.splitlines() == [
        "hf-tp: warning: torch 2.14.0 is newer than the newest release hf_tp is tested with (2.13); it may work: "
        "report what breaks, or pip install 'torch<2.14'",
        "hf-tp: warning: accelerate 1.17.2 is newer than the newest release hf_tp is tested with (1.16); it may "
        "work: report what breaks, or pip install 'accelerate<1.17'",
    ]
    assert os.environ[releases.REPORTED_ENV] == "accelerate,torch"  # the ranks hf-tp train launches inherit it
