"""The embedded default (tiny Llama + generated corpus): loadable, cached, deterministic, atomic, learnable."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tp.demo.assets as default
from hf_tp.demo.assets import ASSETS_NAME, MARKER, DefaultAssets, default_cache_dir, ensure_default_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> DefaultAssets:
    return ensure_default_assets(tmp_path_factory.mktemp("cache"))


def _files(final: Path) -> dict[str, int]:
    return {str(p.relative_to(final)): p.stat().st_mtime_ns for p in sorted(final.rglob("*")) if p.is_file()}


def _packed_blocks(assets: DefaultAssets, tokenizer, block: int = 64) -> torch.Tensor:
    ids: list[int] = []
    for line in assets.data_file.read_text().splitlines():
        ids += tokenizer(line).input_ids + [tokenizer.eos_token_id]
    n = len(ids) // block
    return torch.tensor(ids[: n * block]).view(n, block)


def test_loads_with_auto_classes_and_starts_near_uniform(assets: DefaultAssets) -> None:
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    assert (tok.unk_token, tok.pad_token, tok.bos_token, tok.eos_token) == ("<unk>", "<pad>", "<s>", "</s>")
    assert 100 <= len(tok) <= 1000 and model.config.vocab_size == len(tok)
    assert model.config.model_type == "llama" and not model.config.tie_word_embeddings
    assert (model.config.pad_token_id, model.config.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert model.dtype == torch.float32
    enc = tok("Anna has a RED ball .")
    assert tok.convert_ids_to_tokens(enc.input_ids) == ["<s>", "anna", "has", "a", "red", "ball", "."]

    lines = assets.data_file.read_text().splitlines()
    assert 1000 <= len(lines) and 100_000 <= assets.data_file.stat().st_size <= 500_000
    assert all(lines), "one non-empty document per line"

    batch = _packed_blocks(assets, tok)[:4]
    with torch.no_grad():
        loss = model(input_ids=batch, labels=batch).loss.item()
    assert math.isfinite(loss) and abs(loss - math.log(len(tok))) < 0.3, (loss, math.log(len(tok)))


def test_second_call_reuses_the_complete_directory(assets: DefaultAssets, monkeypatch) -> None:
    final = assets.model_dir.parent
    before = _files(final)
    monkeypatch.setattr(default, "_build", lambda out: pytest.fail("rebuilt a complete directory"))
    assert ensure_default_assets(final.parent) == assets
    assert _files(final) == before


def test_two_roots_give_identical_assets(assets: DefaultAssets, tmp_path: Path) -> None:
    other = ensure_default_assets(tmp_path)
    assert other.data_file.read_bytes() == assets.data_file.read_bytes()
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        assert (other.model_dir / name).read_bytes() == (assets.model_dir / name).read_bytes(), name
    a, b = load_file(assets.model_dir / "model.safetensors"), load_file(other.model_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    want = torch.get_rng_state()
    ensure_default_assets(tmp_path)
    assert torch.equal(torch.get_rng_state(), want)


def test_stale_tmp_dir_and_incomplete_final_are_not_used(tmp_path: Path) -> None:
    young = tmp_path / f".tmp-{ASSETS_NAME}-young"  # maybe another process's build in progress: kept
    old = tmp_path / f".tmp-{ASSETS_NAME}-old"  # left by a process that died long ago: removed
    for d in (young, old):
        d.mkdir()
        (d / "corpus.txt").write_text("half written\n")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    final = tmp_path / ASSETS_NAME
    final.mkdir()
    (final / "corpus.txt").write_text("half written\n")  # no marker: incomplete

    got = ensure_default_assets(tmp_path)
    assert got.model_dir.parent == final and (final / MARKER).is_file()
    assert got.data_file.read_text() != "half written\n"
    AutoModelForCausalLM.from_pretrained(got.model_dir)
    assert young.is_dir() and not old.exists()
    leftovers = {p.name for p in tmp_path.iterdir()} - {ASSETS_NAME, young.name}
    assert not leftovers, leftovers


def test_losing_a_race_uses_the_winners_directory(tmp_path: Path, monkeypatch) -> None:
    real_build = default._build
    calls = []

    def build_then_lose(out: Path) -> None:
        calls.append(out)
        real_build(out)
        if len(calls) == 1:  # another process finishes first, while we are still building
            ensure_default_assets(tmp_path)

    monkeypatch.setattr(default, "_build", build_then_lose)
    final = tmp_path / ASSETS_NAME
    got = ensure_default_assets(tmp_path)
    assert len(calls) == 2 and got.model_dir.parent == final
    assert not calls[0].exists()  # the loser's temp dir is gone
    assert [p.name for p in tmp_path.iterdir()] == [ASSETS_NAME]


def test_cache_dir_honours_hf_tp_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_TP_CACHE", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hf_tp"
    monkeypatch.setenv("HF_TP_CACHE", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    got = ensure_default_assets()
    assert got.model_dir == tmp_path / "cache" / ASSETS_NAME / "model" and got.data_file.is_file()


def test_a_short_training_run_lowers_the_loss(assets: DefaultAssets) -> None:
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    blocks = _packed_blocks(assets, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        batch = blocks[torch.randint(0, len(blocks), (8,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
