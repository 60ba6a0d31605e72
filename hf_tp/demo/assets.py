"""The embedded default: a tiny Llama and a generated corpus, built locally with no network.

``hf-tp train`` without ``--model``/``--dataset`` trains on these. Fixed seeds (a ``random.Random``
grammar for the text, ``torch.manual_seed(0)`` for the weights) make every machine build byte-identical
assets, and the text is structured enough for the loss to fall visibly within ~100 optimizer steps.
They are cached under :func:`default_cache_dir`, built in a temporary sibling directory and renamed
into place when complete, so a crash or a concurrent build never leaves a half-written directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hf_tp.demo.corpus import generate_corpus

if TYPE_CHECKING:  # imported where the assets are built: finding built ones needs no torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

# Bump the suffix whenever the grammar, tokenizer or model changes, so stale caches are not reused.
ASSETS_NAME = "default-tiny-llama-v1"
MODEL_SUBDIR = "model"
DATA_FILENAME = "corpus.txt"
MARKER = "COMPLETE"  # written last (inside the temporary directory, before the rename)
SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>")
MAX_POSITIONS = 512
_TMP_PREFIX = f".tmp-{ASSETS_NAME}-"
_STALE_TMP_AGE_S = 3600.0  # a build takes seconds; older temporary dirs were left by dead processes


@dataclass(frozen=True)
class DefaultAssets:
    """Paths of the embedded default (both inside one cached directory)."""

    model_dir: Path  # config.json + model.safetensors + tokenizer files (from_pretrained-loadable)
    data_file: Path  # a .txt corpus, one document per line


def default_cache_dir() -> Path:
    """``$HF_TP_CACHE`` if set, else ``~/.cache/hf_tp``."""
    env = os.environ.get("HF_TP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_tp"


def ensure_default_assets(root: Path | None = None) -> DefaultAssets:
    """Return the embedded default under ``root`` (default: :func:`default_cache_dir`), building it once.

    A complete directory (it holds the marker file) is reused as is. Otherwise the assets are built
    in a temporary sibling directory and renamed into place; if another process wins that race, its
    directory is used and ours is deleted. A final directory without the marker is replaced.
    """
    root = Path(root) if root is not None else default_cache_dir()
    final = root / ASSETS_NAME
    if _is_complete(final):
        return _assets(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=root))
    except OSError as e:
        raise OSError(
            f"cannot write the default model and corpus under {root} ({e}); set HF_TP_CACHE to a writable directory"
        ) from e
    _remove_stale_tmp_dirs(root, keep=tmp)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        _build(tmp)
        for _ in range(5):
            if _is_complete(final):
                break  # another process finished first: use its directory
            try:
                os.rename(tmp, final)  # atomic; fails if ``final`` exists (a winner or a broken dir)
                return _assets(final)
            except OSError:
                if not _is_complete(final):
                    _discard_incomplete(final, root)
        else:
            raise RuntimeError(f"could not install the default assets at {final}; is {root} writable?")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename
    return _assets(final)


def _assets(final: Path) -> DefaultAssets:
    return DefaultAssets(model_dir=final / MODEL_SUBDIR, data_file=final / DATA_FILENAME)


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def _discard_incomplete(final: Path, root: Path) -> None:
    """Move a final directory without the marker aside (atomically) and delete it."""
    trash = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=root))
    try:
        try:
            os.rename(final, trash / "old")
        except FileNotFoundError:
            return  # another process already moved it
        if _is_complete(trash / "old"):  # a winner renamed in between our check and the move: put it back
            try:
                os.rename(trash / "old", final)
            except OSError:
                pass  # yet another complete one is in place; ours is a duplicate
    finally:
        shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_tmp_dirs(root: Path, keep: Path) -> None:
    """Delete temporary build directories left behind by processes that died long ago."""
    now = time.time()
    for path in root.glob(f"{_TMP_PREFIX}*"):
        try:
            if path != keep and now - path.stat().st_mtime > _STALE_TMP_AGE_S:
                shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            pass


def _build(out: Path) -> None:
    """Write the corpus, the tokenizer and the model into ``out``, then the marker."""
    lines = generate_corpus()
    data_file = out / DATA_FILENAME
    data_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    model_dir = out / MODEL_SUBDIR
    tokenizer = build_tokenizer(lines)
    tokenizer.save_pretrained(model_dir)
    model = build_tiny_llama(tokenizer)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar is noise here
    try:
        model.save_pretrained(model_dir)  # model.safetensors
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    for path in out.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # safetensors writes 0600; the cache may be shared
    (out / MARKER).write_text(f"{ASSETS_NAME}\n")


def build_tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    """A lowercase word-level tokenizer (words and single punctuation marks) trained on ``lines``.

    Like Llama's tokenizers it prepends ``<s>`` to every encoded text; ``</s>`` is the end token.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    unk, pad, bos, eos = SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    tok.train_from_iterator(lines, trainer=trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS)))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces, "word ." -> "word."
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=unk,
        pad_token=pad,
        bos_token=bos,
        eos_token=eos,
        model_max_length=MAX_POSITIONS,
    )


def build_tiny_llama(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A ~150k-parameter Llama in float32, initialised from ``torch.manual_seed(0)``.

    The global RNG state of the caller is restored afterwards.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=torch.float32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
