"""Readers for the STS evaluation sets in SentEval's layout, faithful to SentEval's loaders.

Every sentence is whitespace-split and re-joined with single spaces, as SentEval's loaders and
SimCSE's batcher do, so scores are comparable with the published tables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .paths import require_file, resolve_data_dir

STS_SUBSETS: dict[str, tuple[str, ...]] = {
    "STS12": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
    "STS13": ("FNWN", "headlines", "OnWN"),
    "STS14": ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"),
    "STS15": ("answers-forums", "answers-students", "belief", "headlines", "images"),
    "STS16": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
}
STS_TASKS = ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness")
# the papers' column names of the tasks whose names differ (and of the average)
SHORT_NAMES = {"STSBenchmark": "STS-B", "SICKRelatedness": "SICK-R", "avg": "Avg."}
DEV_TASKS = ("STSBenchmark-dev", "SICKRelatedness-dev")


@dataclass
class StsTask:
    """Sentence pairs with gold scores; `subsets[i]` names the subset pair i comes from."""

    name: str
    first: list[str]
    second: list[str]
    gold: np.ndarray
    subsets: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.gold)


def normalize_sentence(sentence: str) -> str:
    """Whitespace runs collapsed to one space, ends stripped (SentEval's readers, and ConSERT's corpus)."""
    return " ".join(sentence.split())


def read_sts_year(directory: str | os.PathLike, name: str) -> StsTask:
    """STS12–16: `STS.input.<subset>.txt` (tab-separated pair) + `STS.gs.<subset>.txt`.

    A blank gold line marks an unscored pair, which SentEval drops.
    """
    directory = Path(directory)
    first, second, gold, subsets = [], [], [], []
    for subset in STS_SUBSETS[name]:
        inputs = require_file(directory / f"STS.input.{subset}.txt", f"{name} input ({subset})")
        scores = require_file(directory / f"STS.gs.{subset}.txt", f"{name} gold scores ({subset})")
        pairs = inputs.read_text(encoding="utf8").splitlines()
        golds = scores.read_text(encoding="utf8").splitlines()
        if len(pairs) != len(golds):
            raise ValueError(f"{inputs} has {len(pairs)} pairs but {scores} has {len(golds)} scores")
        for line, score in zip(pairs, golds, strict=True):
            if score.strip() == "":
                continue
            a, b = line.split("\t")[:2]
            first.append(normalize_sentence(a))
            second.append(normalize_sentence(b))
            gold.append(float(score))
            subsets.append(subset)
    return StsTask(name, first, second, np.asarray(gold, dtype=np.float64), subsets)


def read_stsb(path: str | os.PathLike, name: str = "STSBenchmark") -> StsTask:
    """STS Benchmark csv: split on tabs (never parse as CSV: quotes and extra columns occur).

    Score in column 5, sentences in columns 6–7; columns past the 7th are ignored.
    """
    path = require_file(path, "STS Benchmark file")
    first, second, gold = [], [], []
    for line in path.read_text(encoding="utf8").splitlines():
        columns = line.strip().split("\t")
        if len(columns) < 7:
            raise ValueError(f"{path}: expected at least 7 tab-separated columns, got {len(columns)}: {line[:80]!r}")
        gold.append(float(columns[4]))
        first.append(normalize_sentence(columns[5]))
        second.append(normalize_sentence(columns[6]))
    return StsTask(name, first, second, np.asarray(gold, dtype=np.float64), [name] * len(gold))


def read_sick(path: str | os.PathLike, name: str = "SICKRelatedness") -> StsTask:
    """SICK: header row, tab-separated `pair_ID, sentence_A, sentence_B, relatedness_score, ...`.

    The test file has CRLF line ends; stripping each line handles both.
    """
    path = require_file(path, "SICK file")
    lines = path.read_text(encoding="utf8").splitlines()[1:]
    first, second, gold = [], [], []
    for line in lines:
        if not line.strip():
            continue
        columns = line.strip().split("\t")
        first.append(normalize_sentence(columns[1]))
        second.append(normalize_sentence(columns[2]))
        gold.append(float(columns[3]))
    return StsTask(name, first, second, np.asarray(gold, dtype=np.float64), [name] * len(gold))


def load_sts_task(name: str, data_dir: str | os.PathLike | None = None) -> StsTask:
    """Load one task by SentEval name: STS12–16, STSBenchmark(-dev), SICKRelatedness(-dev)."""
    root = resolve_data_dir(data_dir) / "senteval" / "downstream"
    if name in STS_SUBSETS:
        return read_sts_year(root / "STS" / f"{name}-en-test", name)
    if name == "STSBenchmark":
        return read_stsb(root / "STS" / "STSBenchmark" / "sts-test.csv", name)
    if name == "STSBenchmark-dev":
        return read_stsb(root / "STS" / "STSBenchmark" / "sts-dev.csv", name)
    if name == "SICKRelatedness":
        return read_sick(root / "SICK" / "SICK_test_annotated.txt", name)
    if name == "SICKRelatedness-dev":
        return read_sick(root / "SICK" / "SICK_trial.txt", name)
    raise ValueError(f"unknown STS task {name!r}; choose from {', '.join(STS_TASKS + DEV_TASKS)}")
