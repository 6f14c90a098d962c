"""The unlabeled sentences of the STS sets as a training corpus (`data.train_file: senteval:sts`): what
ConSERT trains on, unsupervised transfer to the target domain.

As ConSERT's reference (`data_utils.load_datasets(..., use_all_unsupervised_texts=True)`): both
sentences of every pair, no label read and none needed (STS12–16's unscored pairs too), in every split
(STS-B train, dev and test; SICK train, trial and test), duplicates kept: 89,192 sentences from
SentEval's files (STS13 without its licensed SMT subset, as SentEval ships it). Whitespace is collapsed
as the evaluation readers do. The corpus is written once, as a one-sentence-a-line file in the cache
directory (`data.senteval_corpora`), and then tokenized and cached like any corpus.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .paths import require_file
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
