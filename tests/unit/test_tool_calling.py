"""Tool-calling chat data: a `tools` column reaches the chat template per row, assistant tool calls
are targets and tool results are not, checked against the template's own rendering; a template
that never reads `tools` is refused in one line."""

from __future__ import annotations

import json

import datasets
import pytest

from hf_tp.data.tokenize import tokenize_dataset
from tests.chat_data import CHATML, chat_tokenizer

TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\ntools : {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('tool_calls') %}"
    "{% for c in m['tool_calls'] %}call {{ c['function']['name'] }} {{ c['function']['arguments']['city'] }}"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
MESSAGES = [
    {"role": "user", "content": "what is the weather in rome ?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "rome"}}}],
    },
    {"role": "tool", "content": "sunny in oslo"},
    {"role": "assistant", "content": "it is sunny in rome ."},
]


@pytest.mark.parametrize("as_json", [True, False], ids=["json-string", "list"])
def test_tools_are_rendered_and_tool_calls_are_targets(as_json: bool) -> None:
    tok = chat_tokenizer(TOOLS_CHATML)
    rows = {"messages": [MESSAGES], "tools": [json.dumps(TOOLS) if as_json else TOOLS]}
    ex = tokenize_dataset(datasets.Dataset.from_dict(rows), tok, seq_len=256, pack=False)[0]
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False)
    assert "tools : weather" in text and "call weather rome" in text  # the template saw the tools
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert ex["input_ids"] == enc["input_ids"]
    labelled = [(a, b) for (a, b), label in zip(enc["offset_mapping"], ex["labels"], strict=True) if label != -100]
    call = text.index("call weather rome")
    result = text.index("<|im_start|>tool")
    assert any(a >= call and b <= call + len("call weather rome") for a, b in labelled)  # the call is learned
    assert not any(result <= a < text.index("<|im_end|>", result) for a, b in labelled)  # the result is not
    assert not any(a < text.index("<|im_start|>user") for a, b in labelled)  # nor the tools block


def test_a_template_without_tools_is_refused_in_one_line() -> None:
    rows = {"messages": [MESSAGES[:1] + [{"role": "assistant", "content": "hi"}]], "tools": [json.dumps(TOOLS)]}
    with pytest.raises(ValueError, match=r"^the dataset has a 'tools' column but the chat template .* does not render"):
        tokenize_dataset(datasets.Dataset.from_dict(rows), chat_tokenizer(CHATML), seq_len=64, pack=False)


def test_bad_tools_name_the_row() -> None:
    rows = {"messages": [MESSAGES, MESSAGES], "tools": [json.dumps(TOOLS), "{not json"]}
    with pytest.raises(ValueError, match=r"row 2 of dataset \(in memory\): 'tools' is a string but not JSON"):
        tokenize_dataset(datasets.Dataset.from_dict(rows), chat_tokenizer(TOOLS_CHATML), seq_len=64, pack=False)


def test_tools_under_another_column_name(tmp_path) -> None:
    """--tools-column functions: the rows render exactly as with a `tools` column."""
    from hf_tp.data import load_text_dataset
    from hf_tp.data.columns import column_renames

    tok = chat_tokenizer(TOOLS_CHATML)
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES, "functions": json.dumps(TOOLS)}) + "\n")
    renames = column_renames({"tools": "functions"})
    got = tokenize_dataset(load_text_dataset(str(path), renames=renames), tok, seq_len=256, pack=False)[0]
    rows = {"messages": [MESSAGES], "tools": [json.dumps(TOOLS)]}
    want = tokenize_dataset(datasets.Dataset.from_dict(rows), tok, seq_len=256, pack=False)[0]
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False)
    assert got == want and got["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
