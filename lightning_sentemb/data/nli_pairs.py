"""Labelled NLI pairs (premise, hypothesis, label), what SBERT's classification objective trains on.

Two layouts, both read by the training corpus reader (`data.corpus`):

- a csv with header `premise,hypothesis,label` (`sentemb data download --what allnli` writes SNLI + MNLI
  train this way, `corpora/allnli_pairs.csv`);
- a folder in SentEval's NLI layout, `s1.<split>`, `s2.<split>`, `labels.<split>` (one sentence or label a
  line), every split present read in the order train, dev, test: the offline mirror's
  `senteval/downstream/SNLI` (SNLI dev and test), which the demo trains on.

Labels are the class names or their ids in the order of the Hugging Face hub's SNLI and MNLI (and
sentence-transformers' all-nli): 0 entailment, 1 neutral, 2 contradiction. A batch of pairs holds the
premises, then the hypotheses (`premises_then_hypotheses`), and their labels (`pair_labels`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from itertools import chain, islice
from pathlib import Path
from typing import Any

import torch

from ..errors import SentEmbUserError

__all__ = ["LABELLED_COLUMNS", "NLI_LABELS", "label_ids", "pair_labels", "premises_then_hypotheses",
           "senteval_nli_rows"]

NLI_LABELS = ("entailment", "neutral", "contradiction")
LABELLED_COLUMNS = ("premise", "hypothesis", "label")
SPLITS = ("train", "dev", "test")
_IDS = {**{name: i for i, name in enumerate(NLI_LABELS)}, **{str(i): i for i in range(len(NLI_LABELS))}}


def label_ids(values: list[str], first_row: int, source: str) -> list[int]:
    """Class ids of label texts (names, any case, or 0/1/2); one error naming the row of the first that
    is neither (`first_row`: the row number of `values[0]`)."""
    ids = [_IDS.get(value.strip().lower(), -1) for value in values]
    if -1 in ids:
        row = ids.index(-1)
        raise SentEmbUserError(
            f"{source}: row {first_row + row} has label {values[row]!r}; labels are {', '.join(NLI_LABELS)} (or 0, 1, "
            "2 in that order): drop unlabelled pairs (SNLI's '-', the hub's -1) first"
        )
    return ids


def senteval_splits(folder: Path) -> list[tuple[Path, Path, Path]]:
    """(s1, s2, labels) files of each split the folder holds, in the order train, dev, test."""
    splits = [tuple(folder / f"{part}.{split}" for part in ("s1", "s2", "labels")) for split in SPLITS]
    present = [files for files in splits if files[0].exists()]
    if not present:
        raise SentEmbUserError(f"{folder}: a training folder must be in SentEval's NLI layout (s1.train, s2.train, "
                               "labels.train, or the dev/test splits); none found")
    return present


def senteval_nli_rows(folder: Path, rows: int) -> Iterator[tuple[dict[str, list], int]]:
    """The folder's pairs in blocks of at most `rows`: ({premise, hypothesis, label}, bytes read)."""
    for files in senteval_splits(folder):
        with ExitStack() as stack:
            handles = [stack.enter_context(open(path, "rb")) for path in files]
            first = 1
            # the shortest file ends the split; the check below refuses files of different lengths
            while block := list(islice(zip(*handles, strict=False), rows)):
                premises, hypotheses, labels = ([line.decode("utf8").strip() for line in part]
                                                for part in zip(*block, strict=True))
                ids = label_ids(labels, first, str(files[2]))
                yield {"premise": premises, "hypothesis": hypotheses, "label": ids}, sum(map(len, chain(*block)))
                first += len(block)
            if any(handle.read(1) for handle in handles):
                raise SentEmbUserError(f"{files[0].parent}: {', '.join(p.name for p in files)} have different numbers "
                                       "of lines; each line of s1 pairs with the same line of s2 and labels")


def premises_then_hypotheses(examples: list[dict[str, Any]]) -> list[list[int]]:
    """The pairs' sentences as a classifier's batch holds them: the premises, then the hypotheses."""
    return [example["premise"] for example in examples] + [example["hypothesis"] for example in examples]


def pair_labels(examples: list[dict[str, Any]]) -> torch.Tensor:
    """The pairs' labels (indices of `NLI_LABELS`)."""
    return torch.tensor([example["label"] for example in examples], dtype=torch.long)
