"""ModelSource: what a user names (a folder, a config.json, a bundled name, a config, a model)
becomes one object with its config, class, weights and remote-code decision; and only
``hf_tp.core.model_source.auto_config`` reads a config with ``from_pretrained``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tp.core.model_source import ModelSource
from tests.helpers import tiny_config
from tests.wrapper_grid import wrapper_config

PACKAGE = Path(__file__).resolve().parents[2] / "hf_tp"
LOADER = ("hf_tp/core/model_source.py", "auto_config")  # the one function allowed to call it


def config_loads(source: str) -> list[tuple[int, str]]:
    """(line, enclosing function) of each ``<X>Config.from_pretrained(...)`` /
    ``config_class.from_pretrained(...)`` call in ``source``."""
    found: list[tuple[int, str]] = []

    def receiver(node: ast.expr) -> str:
        if isinstance(node, ast.Subscript):  # CONFIG_MAPPING[model_type].from_pretrained
            return receiver(node.value)
        if isinstance(node, ast.Call):  # type(config).from_pretrained
            return receiver(node.func) if not node.args else "Config" if receiver(node.func) == "type" else ""
        return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained":
            name = receiver(node.func.value)
            if name.endswith(("Config", "config", "config_class")) or name.startswith("CONFIG_MAPPING"):
                found.append((node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "")
    return found


def test_one_function_reads_a_config_with_from_pretrained() -> None:
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent).as_posix()
        calls += [(where, line, fn) for line, fn in config_loads(path.read_text()) if (where, fn) != LOADER]
    assert not calls, "read configs through hf_tp.core.model_source.ModelSource (auto_config), not: " + "; ".join(
        f"{w}:{line} in {fn or 'the module'}" for w, line, fn in calls
    )
    loader = (PACKAGE / "core" / "model_source.py").read_text()
    assert {fn for _, fn in config_loads(loader)} == {"auto_config"}


def test_the_finder_sees_each_spelling() -> None:
    source = """
from transformers import AutoConfig, LlamaConfig
AutoConfig.from_pretrained("x")
def f(config, model):
    LlamaConfig.from_pretrained("x")
    transformers.AutoConfig.from_pretrained("x", trust_remote_code=True)
    model.config_class.from_pretrained("x")
    CONFIG_MAPPING["llama"].from_pretrained("x")
    type(config).from_pretrained("x")
    AutoModelForCausalLM.from_pretrained("x")  # a model, not a config: allowed
    AutoTokenizer.from_pretrained("x")
"""
    assert config_loads(source) == [(3, ""), (5, "f"), (6, "f"), (7, "f"), (8, "f"), (9, "f")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Llama saved with save_pretrained (config and weights)."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(out)
    return out


def test_a_folder_is_config_class_and_weights(folder: Path) -> None:
    for source in (ModelSource.for_training(str(folder)), ModelSource.for_shapes(str(folder)), ModelSource.at(folder)):
        assert (source.name, source.weights, source.module) == (str(folder), str(folder), None)
        assert source.config.model_type == "llama" and source.model_class is AutoModelForCausalLM
        assert not source.runs_own_code
    model = ModelSource.at(folder).load(dtype=torch.float32)
    want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert ModelSource.at(folder).local_dir() == folder


def test_a_config_file_and_a_bundled_name_are_shapes_only(folder: Path) -> None:
    from_file = ModelSource.for_shapes(folder / "config.json")
    assert (from_file.name, from_file.weights) == (str(folder / "config.json"), None)
    bundled = ModelSource.for_shapes("QWEN2-0.5B")
    assert (bundled.name, bundled.weights, bundled.config.hidden_size) == ("Qwen/Qwen2-0.5B", None, 896)
    assert ModelSource.for_shapes("Qwen/Qwen2-0.5B").config.to_dict() == bundled.config.to_dict()  # offline
    for call in (bundled.load, bundled.local_dir):
        with pytest.raises(ValueError, match=r"^Qwen/Qwen2-0\.5B is a config only, with no (weights|files)"):
            call()


def test_a_config_or_a_module_is_taken_as_it_is() -> None:
    config = tiny_config("llama")
    assert ModelSource.for_shapes(config) == ModelSource(config)
    model = AutoModelForCausalLM.from_config(config)
    source = ModelSource.for_shapes(model)
    assert source.module is model and source.config is model.config and source.weights is None


def test_a_multimodal_wrapper_is_built_as_its_own_class() -> None:
    source = ModelSource.for_shapes(wrapper_config("llava"))
    assert source.model_class.__name__ == "LlavaForConditionalGeneration"
    with torch.device("meta"):
        assert type(source.build()) is source.model_class


def test_a_folder_without_config_and_an_unknown_model_type(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        ModelSource.for_shapes(str(tmp_path))
    assert str(info.value) == f"local directory '{tmp_path}' has no config.json; pass a model dir or a config.json file"
    (tmp_path / "config.json").write_text('{"model_type": "no-such-type"}')
    with pytest.raises(ValueError) as info:
        ModelSource.for_shapes(str(tmp_path))
    assert str(info.value) == "config.json has model_type 'no-such-type', which transformers does not know"


def test_estimate_takes_what_its_model_flag_takes() -> None:
    from hf_tp.estimate import estimate

    with pytest.raises(ValueError, match=r"tp must divide num_attention_heads \(14\) of this qwen2 model"):
        estimate("qwen2-0.5b", tp=4, dp=1, seq_len=128, batch_size=1)


def test_core_imports_no_tool() -> None:
    from tests.unit.test_structure import import_graph

    tools = ("hf_tp.train", "hf_tp.plan", "hf_tp.estimate", "hf_tp.verify", "hf_tp.cli", "hf_tp.checkpoint")
    climbs = {
        (module, target)
        for module, targets in import_graph().items()
        if module.startswith("hf_tp.core")
        for target in targets
        if target.startswith(tools)
    }
    assert not climbs, f"hf_tp/core imports a tool: {sorted(climbs)}"
