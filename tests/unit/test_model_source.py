"""check_model_source: a local model folder is complete and readable before any rank starts, and a
path that is not there says so (not a Hub error)."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest

from hf_tp.core.model_files import check_model_source, looks_local


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from hf_tp.demo.assets import ensure_default_assets

    return ensure_default_assets(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def built(tmp_path_factory, assets) -> dict[str, Path]:
    """A tiny Llama saved whole and sharded, each with the embedded default's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    root = tmp_path_factory.mktemp("models")
    out = {"whole": root / "whole", "sharded": root / "sharded"}
    model.save_pretrained(out["whole"])
    model.save_pretrained(out["sharded"], max_shard_size="4KB")
    for folder in out.values():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(assets.model_dir / name, folder / name)
    return out


@pytest.fixture
def whole(built, tmp_path) -> Path:
    return Path(shutil.copytree(built["whole"], tmp_path / "whole"))


@pytest.fixture
def sharded(built, tmp_path) -> Path:
    return Path(shutil.copytree(built["sharded"], tmp_path / "sharded"))


def _message(model: str | Path) -> str:
    with pytest.raises(ValueError) as info:
        check_model_source(str(model))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_names_are_transformers_names() -> None:
    import transformers.utils as tu

    import hf_tp.core.model_files as ms

    for name in ("SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "WEIGHTS_INDEX_NAME", "CONFIG_NAME"):
        assert getattr(ms, name) == getattr(tu, name)


def test_complete_folders_pass(built, assets) -> None:
    assert len(list(built["sharded"].glob("model-*.safetensors"))) > 1  # it did shard
    assert (built["sharded"] / "model.safetensors.index.json").is_file()
    for folder in (built["whole"], built["sharded"], assets.model_dir):
        t0 = time.perf_counter()
        check_model_source(str(folder))
        assert time.perf_counter() - t0 < 1.0


def test_complete_folder_loads(built) -> None:
    """What passes is what from_pretrained loads (the sharded folder, the tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(built["sharded"])
    AutoTokenizer.from_pretrained(built["sharded"])


def test_pytorch_bin_and_unindexed_safetensors_pass(whole) -> None:
    import torch
    from safetensors.torch import load_file

    state = load_file(whole / "model.safetensors")
    torch.save(state, whole / "pytorch_model.bin")
    (whole / "model.safetensors").rename(whole / "model.fp16.safetensors")  # hf_tp's reader reads any name
    check_model_source(str(whole))
    (whole / "model.fp16.safetensors").unlink()
    check_model_source(str(whole))  # pytorch_model.bin alone
    data = (whole / "pytorch_model.bin").read_bytes()
    (whole / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    assert _message(whole) == (
        f"model folder '{whole}' has damaged weights: pytorch_model.bin is truncated (an incomplete zip archive); "
        "copy or download it again"
    )


def test_no_weights(whole) -> None:
    (whole / "model.safetensors").unlink()
    assert _message(whole) == (
        f"model folder '{whole}' has no weights (no model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json); copy the weight files into it (save_pretrained "
        "writes them)"
    )


def test_index_names_a_missing_shard(sharded) -> None:
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    (sharded / shards[1]).unlink()
    assert _message(sharded) == (
        f"model folder '{sharded}' lacks 1 of the {len(shards)} weight shards that model.safetensors.index.json "
        f"names: {shards[1]}; copy the missing shard files into it"
    )


def test_damaged_index(sharded) -> None:
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {"a": ')
    assert _message(sharded).startswith(
        f"model folder '{sharded}' has a damaged model.safetensors.index.json (not valid JSON: "
    )


def test_truncated_safetensors(whole) -> None:
    path = whole / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    assert _message(whole) == (
        f"model folder '{whole}' has damaged weights: model.safetensors is truncated ({len(data) - 1000} of "
        f"{len(data)} bytes); copy or download it again"
    )


def test_truncated_shard(sharded) -> None:
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:100])  # inside the header
    (n,) = struct.unpack("<Q", data[:8])
    assert _message(sharded) == (
        f"model folder '{sharded}' has damaged weights: {shard.name} is truncated (100 bytes; its header alone "
        f"needs {8 + n}); copy or download it again"
    )


def test_longer_safetensors(whole) -> None:
    path = whole / "model.safetensors"
    size = path.stat().st_size
    with path.open("ab") as fh:
        fh.write(b"\0" * 10)
    assert _message(whole) == (
        f"model folder '{whole}' has damaged weights: model.safetensors is longer than its header says "
        f"({size + 10} bytes, not {size}); copy or download it again"
    )


def test_corrupted_header_bytes(whole) -> None:
    path = whole / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe#!"  # the JSON header's first bytes
    path.write_bytes(bytes(data))
    assert _message(whole).startswith(
        f"model folder '{whole}' has damaged weights: model.safetensors has a damaged header (not valid JSON: "
    )
    data[0:8] = b"\xff" * 8  # the header length
    path.write_bytes(bytes(data))
    assert _message(whole) == (
        f"model folder '{whole}' has damaged weights: model.safetensors has a damaged header (its first 8 bytes "
        f"give a {2**64 - 1}-byte header); copy or download it again"
    )


def test_header_safetensors_itself_refuses(whole) -> None:
    """Offsets that cover the file but disagree with a tensor's shape: safe_open's own check."""
    path = whole / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [*header[key]["shape"], 3]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    assert _message(whole).startswith(f"model folder '{whole}' has damaged weights: model.safetensors cannot be read (")


def test_only_config_json(whole, tmp_path) -> None:
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(whole / "config.json", only / "config.json")
    shutil.copy(whole / "model.safetensors", only / "model.safetensors")
    message = _message(only)
    assert message == (
        f"model folder '{only}' has no tokenizer files (tokenizer.json, or a vocabulary such as tokenizer.model "
        "or vocab.json + merges.txt); copy the tokenizer's files into it (tokenizer.save_pretrained writes them)"
    )
    assert "sentencepiece" not in message
    (only / "model.safetensors").unlink()
    assert "has no weights" in _message(only)  # weights are named first


def test_tokenizer_config_alone_is_not_a_tokenizer(whole) -> None:
    (whole / "tokenizer.json").unlink()
    assert "has no tokenizer files (tokenizer.json" in _message(whole)


def test_damaged_tokenizer_json(whole) -> None:
    (whole / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    assert _message(whole).startswith(
        f"model folder '{whole}' has a damaged tokenizer.json (not valid JSON: Expecting property name"
    )


def test_no_or_damaged_config(whole) -> None:
    (whole / "config.json").write_text("{'model_type': 'llama'}")
    assert _message(whole).startswith(f"model folder '{whole}' has a damaged config.json (not valid JSON: ")
    (whole / "config.json").unlink()
    assert _message(whole) == (
        f"model folder '{whole}' has no config.json; pass a folder written by save_pretrained (config.json, "
        "weights, tokenizer)"
    )


def test_a_file_is_not_a_model_folder(whole) -> None:
    assert _message(whole / "config.json") == (
        f"model not found: '{whole / 'config.json'}' is a file; pass the model's folder (config.json, weights, "
        "tokenizer files)"
    )


def test_nonexistent_paths(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for model in ("/nonexistent/dir", "./mymodel", "~/no-such-model-dir-xyz", "models/a/b", "my model"):
        assert _message(model) == f"model not found: no file or directory at '{model}'"


def test_hub_ids_are_left_to_loading(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for model in ("Qwen/Qwen2-0.5B", "gpt2", "mymodel_dir"):
        assert not looks_local(model)
        check_model_source(model)  # online: not checked here (the ranks may download it)


def test_offline_cached_snapshot_is_checked(whole, tmp_path, monkeypatch) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    shutil.copy(whole / "config.json", snapshot / "config.json")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: str(snapshot / name))
    assert _message("some-org/tiny") == (
        f"the Hub cache's copy of 'some-org/tiny' ({snapshot}) has no weights (no model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json); unset HF_HUB_OFFLINE "
        "so that it is downloaded"
    )
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    check_model_source("some-org/tiny")  # not cached: loading says so


def test_load_model_config_nonexistent_path() -> None:
    from hf_tp.run.validate import load_model_config

    with pytest.raises(ValueError) as info:
        load_model_config("/nonexistent/dir")
    assert str(info.value) == "model not found: no file or directory at '/nonexistent/dir'"


def test_load_model_config_bare_name_hub_unreachable(tmp_path, monkeypatch) -> None:
    import hf_tp.core.model_source
    from hf_tp.run.validate import load_model_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hf_tp.core.model_source, "hub_unreachable", lambda: "ConnectError: Name or service not known")
    with pytest.raises(ValueError) as info:
        load_model_config("mymodel_dir")
    assert str(info.value) == (
        f"model not found: there is no directory 'mymodel_dir' in {tmp_path}, and no Hub model 'mymodel_dir' in "
        "the Hub cache (the Hub cannot be reached: ConnectError: Name or service not known); pass a model "
        "folder's path, or a Hub id (most are owner/name, e.g. Qwen/Qwen2-0.5B)"
    )


def _repo_not_found(monkeypatch) -> None:
    """The Hub answers, and has no such repository (as huggingface_hub reports a 404)."""
    import huggingface_hub.errors as errors
    import transformers.utils.hub

    import hf_tp.core.model_source

    def not_found(repo_id, *args, **kwargs):
        url = f"https://huggingface.co/{repo_id}/resolve/main/config.json"
        client = sys.modules[errors.Response.__module__.split(".")[0]]  # huggingface_hub's HTTP client
        response = client.Response(404, request=client.Request("HEAD", url))
        raise errors.RepositoryNotFoundError(
            f"404 Client Error. Repository Not Found for url: {url}", response=response
        )

    monkeypatch.setattr(hf_tp.core.model_source, "hub_unreachable", lambda: None)
    monkeypatch.setattr(transformers.utils.hub, "hf_hub_download", not_found)


def test_load_model_config_not_on_the_hub(tmp_path, monkeypatch) -> None:
    from hf_tp.run.validate import load_model_config

    monkeypatch.chdir(tmp_path)
    _repo_not_found(monkeypatch)
    with pytest.raises(ValueError) as info:
        load_model_config("mymodel_dir")
    assert str(info.value) == (
        f"model not found: there is no directory 'mymodel_dir' in {tmp_path}, and no model 'mymodel_dir' on the "
        "Hub; pass a model folder's path, or a Hub id (most are owner/name, e.g. Qwen/Qwen2-0.5B)"
    )
    with pytest.raises(ValueError) as info:
        load_model_config("some-org/no-such-model")
    assert str(info.value) == (
        "model not found: no model 'some-org/no-such-model' on the Hub and no local directory of that name; check "
        "the id, or log in (hf auth login) if it is a private model"
    )


def test_broken_link(whole) -> None:
    """A Hub cache snapshot links its files to blobs; a link to nothing is named."""
    (whole / "model.safetensors").unlink()
    (whole / "model.safetensors").symlink_to(whole / "no-such-blob")
    assert _message(whole) == (
        f"model folder '{whole}' has a broken link: model.safetensors points to no file; copy or download it again"
    )
