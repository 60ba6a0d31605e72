"""One row at a time: what is wrong with a raw row of a format (checked before any tokenizer
runs), and a batch of rows turned into documents, each bad row either stopping the run with a
line that names it or, with ``--skip-bad-rows``, dropped and recorded.

A dropped row leaves a document without tokens whose ``skipped`` column says why; a good one has
``skipped == ""``. :func:`hf_tp.data.tokenize.tokenize_dataset` and the stream filter them out.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from hf_tp.data.formats.chat import encode_conversation, messages_problem, normalize_messages
from hf_tp.data.formats.completion import COMPLETION, PROMPT, encode_pair, pair_problem
from hf_tp.data.formats.data_format import CHAT, IMAGES, PREFERENCE, TEXT, DataFormat
from hf_tp.data.formats.preference import COLUMNS as PAIR_COLUMNS
from hf_tp.data.formats.preference import encode_preference_row, preference_problem
from hf_tp.data.formats.text import encode_text_batch, text_problem
from hf_tp.data.formats.tools import TOOLS_COLUMN, row_tools, tools_problem
from hf_tp.data.places import RowPlaces, summarize_places

SKIPPED = "skipped"  # the column that records why a row was dropped
ROW_COLUMN = "__hf_tp_row__"  # where present, a row's number in the dataset as loaded (a split's rows are renumbered)
# What rendering or tokenizing one bad row raises (a template's raise_exception is a TemplateError).
_ROW_ERRORS = (ValueError, TypeError, KeyError, IndexError, TemplateError)


def row_problem(fmt: DataFormat, row: dict[str, Any]) -> str | None:
    """What is wrong with ``row`` as data of ``fmt`` (type, missing key, empty or null field), or None."""
    if fmt.kind == TEXT:
        return text_problem(row.get(fmt.column), fmt.column)
    if fmt.kind == CHAT:
        return messages_problem(row.get(fmt.column)) or tools_problem(row.get(TOOLS_COLUMN))
    if fmt.kind == PREFERENCE:
        return preference_problem(row)
    if fmt.kind == IMAGES:  # image files are checked where the dataset's folder is known (row_checks)
        from hf_tp.data.formats.images import image_row_problem

        return image_row_problem({"messages": row.get(fmt.column), "images": row.get("images")}, files=False)
    return pair_problem(row.get(PROMPT), row.get(COMPLETION))


def encode_rows(
    fmt: DataFormat,
    batch: dict[str, list],
    indices: list[int],
    tokenizer: Any,
    label: str,
    skip: bool,
    places: RowPlaces | None = None,
) -> dict[str, list]:
    """Rows of a ``datasets.map(batched=True, with_indices=True)`` batch -> documents. A bad row
    raises a ``ValueError`` naming it by its place (``line N of FILE: what``, or ``row N of dataset
    LABEL: what``, counted from 1: :class:`hf_tp.data.places.RowPlaces`, by default of the whole
    dataset ``label`` names), or with ``skip`` becomes an empty document whose ``skipped`` column
    holds that line."""
    places = places or RowPlaces(label)
    if ROW_COLUMN in batch:
        batch = dict(batch)
        indices = batch.pop(ROW_COLUMN)
    n = len(next(iter(batch.values()))) if batch else 0
    rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]
    columns = ["input_ids"] if fmt.kind == TEXT else PAIR_COLUMNS if fmt.kind == PREFERENCE else ["input_ids", "labels"]
    out: dict[str, list] = {name: [] for name in (*columns, SKIPPED)}

    def drop(where: str, problem: str) -> None:
        line = problem if problem.startswith(where) else f"{where}: {problem}"
        if not skip:
            raise ValueError(line)
        for name in columns:
            out[name].append(False if name == "truncated" else [])
        out[SKIPPED].append(line)

    good = []
    for i, row in zip(indices, rows, strict=True):
        where = places(i)
        problem = row_problem(fmt, row)
        if problem is not None:
            drop(where, problem)
        elif fmt.kind == TEXT:
            good.append(row[fmt.column])
        else:
            try:
                example = _encode_row(fmt, row, tokenizer, where)
            except _ROW_ERRORS as exc:
                drop(where, _explain(exc))
                continue
            for name in columns:
                out[name].append(example[name])
            out[SKIPPED].append("")
    if good:
        docs = encode_text_batch({fmt.column: good}, tokenizer, column=fmt.column)["input_ids"]
        out["input_ids"] += docs
        out[SKIPPED] += [""] * len(docs)
    if not skip:
        del out[SKIPPED]
    return out


def skipped_summary(lines: list[str], label: str, shown: int = 3) -> str:
    """One line on the rows ``--skip-bad-rows`` dropped (``lines``: ``PLACE: what``): how many,
    their places (the first ten) and what was wrong with the first ``shown``."""
    places = summarize_places([line.split(": ", 1)[0] for line in lines[:10]], known=f"dataset {label}")
    more = f" and {len(lines) - 10} more" if len(lines) > 10 else ""
    reasons = "; ".join(line.split(": ", 1)[-1] for line in lines[:shown])
    rows = "row" if len(lines) == 1 else "rows"
    return f"hf-tp: --skip-bad-rows dropped {len(lines)} bad {rows} of dataset {label}: {places}{more} ({reasons})"


def _encode_row(fmt: DataFormat, row: dict[str, Any], tokenizer: Any, where: str) -> dict[str, Any]:
    if fmt.kind == PREFERENCE:
        return encode_preference_row(tokenizer, row, fmt.seq_len, where)
    if fmt.kind == CHAT:
        messages, tools = normalize_messages(row[fmt.column], where), row_tools(row.get(TOOLS_COLUMN))
        ids, labels = encode_conversation(
            tokenizer, messages, assistant_only=fmt.assistant_only, where=where, tools=tools
        )
    else:
        ids, labels = encode_pair(
            tokenizer, row[PROMPT], row[COMPLETION], completion_only=fmt.assistant_only, where=where
        )
    return {"input_ids": ids, "labels": labels}


def _explain(exc: BaseException) -> str:
    if isinstance(exc, ValueError):
        return str(exc)
    if isinstance(exc, TemplateError):
        return f"the chat template rejects this conversation ({exc})"
    return f"it cannot be rendered or tokenized ({type(exc).__name__}: {exc})"
