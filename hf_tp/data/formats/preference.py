"""Preference data, TRL's format: ``prompt`` / ``chosen`` / ``rejected``, as strings or as
conversations (lists of role/content messages, rendered with the chat template). Without a
``prompt`` column, a conversation's prompt is the turns that ``chosen`` and ``rejected`` share
(TRL's implicit prompt).

One pair becomes one example: ``input_ids`` / ``labels`` of prompt + chosen and
``rejected_input_ids`` / ``rejected_labels`` of prompt + rejected, the prompt's labels -100. The
tokens are TRL's: string rows are tokenized whole with the tokenizer's special tokens, the eos
string appended to a completion that lacks it; conversations are the template's rendering of
prompt + completion, the prompt (rendered with the generation prompt) left out of the targets
where its tokens are a prefix of both renderings (TRL's rule when a template renders the prompt
differently alone: the completion starts where they diverge).
"""

from __future__ import annotations

from typing import Any

from hf_tp.data.formats.chat import check_chat_tokenizer, messages_problem, normalize_messages
from hf_tp.data.formats.completion import describe_value
from hf_tp.data.formats.data_format import PREFERENCE, DataFormat
from hf_tp.labels import IGNORE_INDEX

PROMPT, CHOSEN, REJECTED = "prompt", "chosen", "rejected"
COLUMNS = ("input_ids", "labels", "rejected_input_ids", "rejected_labels", "truncated")


def is_preference_data(columns: list[str]) -> bool:
    """A dataset with ``chosen`` and ``rejected`` columns holds preference pairs."""
    return CHOSEN in columns and REJECTED in columns


def preference_problem(row: dict[str, Any]) -> str | None:
    """What makes a preference row unusable (a missing or empty side, mixed kinds, chosen equal to
    rejected, an implicit prompt that is not a shared conversation prefix), or None."""
    chosen, rejected, prompt = row.get(CHOSEN), row.get(REJECTED), row.get(PROMPT)
    for name, value in ((CHOSEN, chosen), (REJECTED, rejected)):
        if value is None:
            return f"'{name}' is missing or null; a preference row needs both chosen and rejected"
        if isinstance(value, str):
            if not value.strip():
                return f"'{name}' is empty"
        elif not isinstance(value, list):
            return f"'{name}' is {describe_value(value)}, not a string or a list of messages"
        elif (problem := messages_problem(value)) is not None:
            return f"'{name}': {problem}"
    if isinstance(chosen, str) != isinstance(rejected, str):
        return "chosen and rejected must both be strings or both be lists of messages"
    if prompt is not None and isinstance(prompt, str) != isinstance(chosen, str):
        return f"the prompt is {describe_value(prompt)}, not the same kind (string or messages) as chosen and rejected"
    if prompt is not None and not isinstance(prompt, str) and (problem := messages_problem(prompt)) is not None:
        return f"'prompt': {problem}"
    if chosen == rejected:
        return "chosen and rejected are identical, so the pair carries no preference; drop the row"
    if prompt is None and isinstance(chosen, str):
        return "a string pair needs a 'prompt' column (only conversations may leave the prompt implicit)"
    if prompt is None and _shared_turns(chosen, rejected) == 0:
        return "chosen and rejected share no leading turn, so there is no implicit prompt; add a 'prompt' column"
    return None


def _shared_turns(chosen: list, rejected: list) -> int:
    """How many leading messages the two conversations share (TRL's ``extract_prompt``)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def encode_preference(tokenizer: Any, row: dict[str, Any], where: str) -> dict[str, list[int]]:
    """The example of one preference row (:data:`COLUMNS`), untruncated."""
    problem = preference_problem(row)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    prompt, chosen, rejected = row.get(PROMPT), row[CHOSEN], row[REJECTED]
    if isinstance(chosen, str):
        eos = tokenizer.eos_token or ""
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        ids = [tokenizer(text, verbose=False)["input_ids"] for text in (prompt, prompt + chosen, prompt + rejected)]
    else:
        check_chat_tokenizer(tokenizer)
        chosen, rejected = normalize_messages(chosen, where), normalize_messages(rejected, where)
        if prompt is None:
            shared = _shared_turns(chosen, rejected)
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        else:
            prompt = normalize_messages(prompt, where)
        ids = [
            _chat_ids(tokenizer, prompt, add_generation_prompt=True),
            _chat_ids(tokenizer, prompt + chosen),
            _chat_ids(tokenizer, prompt + rejected),
        ]
    prompt_ids, chosen_ids, rejected_ids = ids
    start = min(_common_prefix(prompt_ids, chosen_ids), _common_prefix(prompt_ids, rejected_ids))
    if start >= len(chosen_ids) or start >= len(rejected_ids):
        raise ValueError(f"{where}: the chosen or the rejected completion has no tokens after the prompt")
    return {
        "input_ids": chosen_ids,
        "labels": [IGNORE_INDEX] * start + chosen_ids[start:],
        "rejected_input_ids": rejected_ids,
        "rejected_labels": [IGNORE_INDEX] * start + rejected_ids[start:],
    }


def _chat_ids(tokenizer: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_preference_row(tokenizer: Any, row: dict[str, Any], seq_len: int | None, where: str) -> dict[str, list]:
    """:func:`encode_preference`, each side cut to ``seq_len`` tokens keeping the start (TRL's
    ``keep_start``); ``truncated`` says whether anything was cut. A prompt of ``seq_len`` tokens or
    more leaves no completion token: a bad row (TRL drops it silently)."""
    example = encode_preference(tokenizer, row, where)
    if seq_len is None:
        return {**example, "truncated": False}
    prompt = next((i for i, t in enumerate(example["labels"]) if t != IGNORE_INDEX), len(example["labels"]))
    if prompt >= seq_len:
        raise ValueError(
            f"{where}: the prompt has {prompt} tokens, which fills --seq-len {seq_len} and leaves no completion "
            "token; raise --seq-len or drop the row"
        )
    cut = len(example["input_ids"]) > seq_len or len(example["rejected_input_ids"]) > seq_len
    return {**{k: v[:seq_len] for k, v in example.items()}, "truncated": cut}


def check_objective_data(objective: str, fmt: DataFormat | None, source: str) -> None:
    """One line when the data's format does not fit ``--objective`` (``fmt`` None: not known yet):
    preference objectives need prompt/chosen/rejected pairs, cross entropy anything else."""
    if fmt is None:
        return
    pairs = fmt.kind == PREFERENCE
    if objective == "sft" and pairs:
        raise ValueError(
            f"dataset '{source}' holds preference pairs (chosen/rejected columns): pass --objective dpo or "
            "--objective simpo, or give prompt/completion or messages data for --objective sft"
        )
    if objective != "sft" and not pairs:
        raise ValueError(
            f"--objective {objective} trains on preference pairs, but dataset '{source}' is "
            f"{fmt.describe()}; give it prompt/chosen/rejected columns (docs/post-training.md)"
        )
