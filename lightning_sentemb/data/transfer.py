"""Readers for the SentEval transfer tasks (MR, CR, SUBJ, MPQA, SST-2, TREC, MRPC).

Each reader follows SentEval's own loader for that task (encoding, label mapping, header
handling), so that sentence counts and labels match the published protocol. SentEval
tokenizes by whitespace and the usual batcher joins the tokens with single spaces; the
readers return that joined form.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from lightning_sentemb.data.paths import require_file, resolve_data_dir

TRANSFER_TASKS: tuple[str, ...] = ("MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC")

# (file read as label 1, file read as label 0), as in SentEval's binary.py.
BINARY_FILES: dict[str, tuple[str, str]] = {
    "MR": ("rt-polarity.pos", "rt-polarity.neg"),
    "CR": ("custrev.pos", "custrev.neg"),
    "SUBJ": ("subj.objective", "subj.subjective"),
    "MPQA": ("mpqa.pos", "mpqa.neg"),
}

TREC_CLASSES: dict[str, int] = {"ABBR": 0, "DESC": 1, "ENTY": 2, "HUM": 3, "LOC": 4, "NUM": 5}

MRPC_HEADER: tuple[str, ...] = ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String")


@dataclass(frozen=True)
class LabelledSentences:
    """One split of a single-sentence task."""

    sentences: list[str]
    labels: np.ndarray  # int64, shape (n,)


@dataclass(frozen=True)
class LabelledPairs:
    """One split of a sentence-pair task (MRPC)."""

    first: list[str]
    second: list[str]
    labels: np.ndarray  # int64, shape (n,)


TransferSplits = dict[str, LabelledSentences | LabelledPairs]


def _join_tokens(text: str) -> str:
    """SentEval's ``text.split()`` followed by the batcher's ``' '.join``."""
    return " ".join(text.split())


def read_binary_task(label1_path: str | os.PathLike, label0_path: str | os.PathLike) -> LabelledSentences:
    """MR/CR/SUBJ/MPQA: one sentence a line, label from the file it is in.

    SentEval reads these as Latin-1 with ``splitlines()`` and keeps empty lines (CR has four,
    MPQA three), so the counts match the published 3775 / 10606.
    """
    groups = []
    for path in (label1_path, label0_path):
        text = require_file(path, "SentEval transfer file").read_text(encoding="latin-1")
        groups.append([_join_tokens(line) for line in text.splitlines()])
    labels = np.array([1] * len(groups[0]) + [0] * len(groups[1]), dtype=np.int64)
    return LabelledSentences(groups[0] + groups[1], labels)


def read_sst_file(path: str | os.PathLike) -> LabelledSentences:
    """SST binary: ``sentence<TAB>label`` per line, UTF-8."""
    path = require_file(path, "SST-2 file")
    sentences, labels = [], []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            fields = line.strip().split("\t")
            if len(fields) != 2 or fields[1] not in ("0", "1"):
                raise ValueError(f"{path}:{number}: expected 'sentence<TAB>0|1', got {line!r}")
            sentences.append(_join_tokens(fields[0]))
            labels.append(int(fields[1]))
    return LabelledSentences(sentences, np.array(labels, dtype=np.int64))


def read_trec_file(path: str | os.PathLike) -> LabelledSentences:
    """TREC: ``COARSE:fine question`` per line, Latin-1 (the training file is not UTF-8).

    Only the coarse label before ':' is kept (6 classes), as in SentEval.
    """
    path = require_file(path, "TREC file")
    sentences, labels = [], []
    with path.open(encoding="latin-1") as f:
        for number, line in enumerate(f, start=1):
            coarse, _, rest = line.strip().partition(":")
            if coarse not in TREC_CLASSES or " " not in rest:
                raise ValueError(f"{path}:{number}: expected 'COARSE:fine question', got {line!r}")
            sentences.append(_join_tokens(rest.split(" ", 1)[1]))
            labels.append(TREC_CLASSES[coarse])
    return LabelledSentences(sentences, np.array(labels, dtype=np.int64))


def read_mrpc_file(path: str | os.PathLike) -> LabelledPairs:
    """MRPC: tab-separated with a header row; the file starts with a UTF-8 byte-order mark."""
    path = require_file(path, "MRPC file")
    with path.open(encoding="utf-8-sig") as f:
        lines = list(f)
    if not lines or tuple(lines[0].strip().split("\t")) != MRPC_HEADER:
        raise ValueError(f"{path}: expected the header {MRPC_HEADER}, got {lines[:1]!r}")
    first, second, labels = [], [], []
    for number, line in enumerate(lines[1:], start=2):
        fields = line.strip().split("\t")
        if len(fields) != 5 or fields[0] not in ("0", "1"):
            raise ValueError(f"{path}:{number}: expected 5 tab-separated fields with label 0|1, got {line!r}")
        first.append(_join_tokens(fields[3]))
        second.append(_join_tokens(fields[4]))
        labels.append(int(fields[0]))
    return LabelledPairs(first, second, np.array(labels, dtype=np.int64))


def load_transfer_task(name: str, data_dir: str | os.PathLike | None = None) -> TransferSplits:
    """All splits of one task: ``{"all"}`` for MR/CR/SUBJ/MPQA, ``{"train","dev","test"}`` for
    SST2, ``{"train","test"}`` for TREC and MRPC."""
    root = resolve_data_dir(data_dir) / "senteval" / "downstream"
    if name in BINARY_FILES:
        label1, label0 = BINARY_FILES[name]
        return {"all": read_binary_task(root / name / label1, root / name / label0)}
    if name == "SST2":
        folder = root / "SST" / "binary"
        return {split: read_sst_file(folder / f"sentiment-{split}") for split in ("train", "dev", "test")}
    if name == "TREC":
        return {
            "train": read_trec_file(root / "TREC" / "train_5500.label"),
            "test": read_trec_file(root / "TREC" / "TREC_10.label"),
        }
    if name == "MRPC":
        return {
            "train": read_mrpc_file(root / "MRPC" / "msr_paraphrase_train.txt"),
            "test": read_mrpc_file(root / "MRPC" / "msr_paraphrase_test.txt"),
        }
    raise ValueError(f"unknown transfer task {name!r}; choose from {', '.join(TRANSFER_TASKS)}")
