"""Training corpora, tokenized once and cached as Arrow files (`datasets`)."""

from __future__ import annotations

import csv
import hashlib
import io
import os
from pathlib import Path

from datasets import Dataset
from lightning.pytorch.utilities import rank_zero_info
from transformers import PreTrainedTokenizerBase

from ..errors import SentEmbUserError
from .paths import default_cache_dir, require_file

NLI_COLUMNS = ("sent0", "sent1", "hard_neg")
CACHE_VERSION = "1"


def read_corpus(path: str | os.PathLike, max_examples: int | None = None) -> dict[str, list[str]]:
    """Columns of raw text: `.txt` = one sentence a line (column `sent0`, blank lines skipped and
    counted); `.csv` = SimCSE's NLI file with header `sent0,sent1[,hard_neg]`.

    A corpus with no sentence, or with bytes that are not UTF-8, is the user's to fix: one error
    naming the file (and the line and byte of the first bad byte)."""
    path = require_file(path, "training corpus")
    text = _decode_utf8(path)
    if path.suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        columns = [c for c in NLI_COLUMNS if c in (reader.fieldnames or [])]
        if columns[:2] != ["sent0", "sent1"]:
            raise SentEmbUserError(f"{path}: an NLI csv needs a header with sent0,sent1[,hard_neg]; got {reader.fieldnames}")
        rows = [row for _, row in zip(range(max_examples or 10**12), reader)]
        corpus = {c: [row[c] for row in rows] for c in columns}
    else:
        lines = text.splitlines()
        sentences = [line.strip() for line in lines if line.strip()]
        skipped = len(lines) - len(sentences)
        if skipped:
            rank_zero_info(f"{path}: skipped {skipped} blank line(s)")
        corpus = {"sent0": sentences[:max_examples] if max_examples else sentences}
    if not corpus["sent0"]:
        raise SentEmbUserError(f"{path}: the training corpus holds no sentence (empty or blank lines only); "
                               "point --data.train_file at a corpus with sentences in it")
    return corpus


def _decode_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise SentEmbUserError(
            f"{path}: not UTF-8 at line {line}, byte offset {error.start} (byte 0x{data[error.start]:02x}); "
            "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None


def _cache_key(path: Path, tokenizer: PreTrainedTokenizerBase, max_tokens: int, max_examples: int | None) -> str:
    stat = path.stat()
    parts = [CACHE_VERSION, str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns),
             tokenizer.name_or_path, str(len(tokenizer)), str(max_tokens), str(max_examples)]
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:16]


def tokenized_corpus(
    path: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    max_tokens: int,
    cache_dir: str | os.PathLike | None = None,
    max_examples: int | None = None,
) -> Dataset:
    """Each text column as token ids without special tokens, cut to `max_tokens`.

    Cached under `cache_dir` by file identity, tokenizer and length. `datasets` writes the
    Arrow file under a temporary name of ours (which it fills through a temporary file of its
    own) and we rename it only once complete, so a killed run never leaves a file at the cached
    name; only the complete file is ever loaded.
    """
    path = Path(path)
    require_file(path, "training corpus")
    cache = Path(cache_dir or default_cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"{path.stem}-{_cache_key(path, tokenizer, max_tokens, max_examples)}.arrow"
    if final.exists():
        return Dataset.from_file(str(final))
    raw = Dataset.from_dict(read_corpus(path, max_examples))

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {
            column: [ids[:max_tokens] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
            for column, texts in batch.items()
        }

    partial = final.with_suffix(f".{os.getpid()}.tmp")
    try:
        raw.map(tokenize, batched=True, batch_size=2000, cache_file_name=str(partial), desc="tokenize")
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return Dataset.from_file(str(final))
