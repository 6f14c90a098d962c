"""The unlabeled sentences of the STS sets as a training corpus (`data.train_file: senteval:sts`): what
ConSERT trains on, unsupervised transfer to the target domain.

As ConSERT's reference (`data_utils.load_datasets(..., use_all_unsupervised_texts=True)`): both
sentences of every pair, no label read and none needed (STS12–16's unscored pairs too), in every split
(STS-B train, dev and test; SICK train, trial and test), duplicates kept: 89,192 sentences from
SentEval's files (STS13 without its licensed SMT subset, as SentEval ships it). Whitespace is collapsed
as the evaluation readers do. The corpus is written once, as a one-sentence-a-line file in the cache
directory, named by the source files' identity, and then tokenized and cached like any corpus.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..atomic_io import atomic_write_text
from .paths import default_cache_dir, require_file
from .senteval import STS_SUBSETS, normalize_sentence

STS_CORPUS = "senteval:sts"


def source_files(data_dir: Path) -> list[tuple[Path, tuple[int, ...], int]]:
    """(file, the columns holding its sentences, header lines to skip), in the corpus's order."""
    root = data_dir / "senteval" / "downstream"
    files = [(root / "STS" / f"{year}-en-test" / f"STS.input.{subset}.txt", (0, 1), 0)
             for year, subsets in STS_SUBSETS.items() for subset in subsets]
    files += [(root / "STS" / "STSBenchmark" / f"sts-{split}.csv", (5, 6), 0) for split in ("train", "dev", "test")]
    files += [(root / "SICK" / f"SICK_{split}.txt", (1, 2), 1) for split in ("train", "trial", "test_annotated")]
    return files


def unlabeled_sts_sentences(data_dir: Path) -> Iterator[str]:
    """Every sentence of every pair of every source file, tab-separated columns, blank lines skipped."""
    for path, columns, header in source_files(data_dir):
        lines = require_file(path, "STS set (ConSERT's training sentences)").read_text(encoding="utf8").splitlines()
        for line in lines[header:]:
            fields = line.strip().split("\t")
            if line.strip():
                yield from (normalize_sentence(fields[c]) for c in columns if c < len(fields))


def sts_corpus_file(data_dir: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """The corpus file, written on first use: staged under a name of this process's, then linked into place
    unless another process was first (every rank then reads one file, whose size and time name the
    tokenized cache)."""
    key = hashlib.sha1()
    for path, _, _ in source_files(data_dir):
        stat = require_file(path, "STS set (ConSERT's training sentences)").stat()
        key.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    target = Path(cache_dir or default_cache_dir()) / f"sts_unlabeled-{key.hexdigest()[:16]}.txt"
    if not target.exists():
        text = "".join(f"{sentence}\n" for sentence in unlabeled_sts_sentences(data_dir))
        staged = atomic_write_text(target.with_name(f".{target.name}.{os.getpid()}"), text)
        try:
            os.link(staged, target)
        except FileExistsError:
            pass
        finally:
            staged.unlink()
    return target
