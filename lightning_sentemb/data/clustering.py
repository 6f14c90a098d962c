"""Readers for the short-text clustering sets (SCCL / ClusterNS / ConPVP) and DBpedia-14.

The short-text files are ``label<TAB>text`` but not uniform: some end lines with CRLF,
StackOverflow adds a trailing tab, Biomedical lacks the final newline. The readers strip
those so that the text a model sees does not depend on which file it came from.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass

import numpy as np

from lightning_sentemb.data.paths import require_file, resolve_data_dir

SHORT_TEXT_DIR = "clustering/short_text/data"

# Task name -> file under the data directory. The first eight are the paper tables' columns.
CLUSTERING_FILES: dict[str, str] = {
    "AgNews": f"{SHORT_TEXT_DIR}/agnewsdataraw-8000",
    "Biomedical": f"{SHORT_TEXT_DIR}/biomedical/biomedical_true_text",
    "GoogleNews-S": f"{SHORT_TEXT_DIR}/S",
    "GoogleNews-T": f"{SHORT_TEXT_DIR}/T",
    "GoogleNews-TS": f"{SHORT_TEXT_DIR}/TS",
    "SearchSnippets": f"{SHORT_TEXT_DIR}/search_snippets/search_snippets_true_text",
    "StackOverflow": f"{SHORT_TEXT_DIR}/stackoverflow/stackoverflow_true_text",
    "Tweet": f"{SHORT_TEXT_DIR}/tweet-original-order.txt",
    "DBpedia": "clustering/dbpedia14_subsample/test.csv",
    "AgNewsFull": "clustering/agnews_full_test/test.csv",
}
CLUSTERING_TASKS: tuple[str, ...] = tuple(CLUSTERING_FILES)
SHORT_TEXT_TASKS: tuple[str, ...] = CLUSTERING_TASKS[:8]

AGNEWS_HEADER = ("Class Index", "Title", "Description")


@dataclass(frozen=True)
class ClusteringData:
    """Texts with their gold class ids (the number of clusters is the number of classes)."""

    sentences: list[str]
    labels: np.ndarray  # int64, shape (n,)


def read_short_text_file(path: str | os.PathLike) -> ClusteringData:
    """``label<TAB>text`` lines; tolerates CRLF, a trailing tab and a missing final newline."""
    path = require_file(path, "short-text clustering file")
    sentences, labels = [], []
    # Split on '\n' only: str.splitlines() would also break on the rare U+2028 / \x1c in texts.
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        label, tab, text = line.partition("\t")
        if not tab or not label.strip().isdigit():
            raise ValueError(f"{path}:{number}: expected 'label<TAB>text', got {line[:80]!r}")
        sentences.append(text.strip())
        labels.append(int(label))
    return ClusteringData(sentences, np.array(labels, dtype=np.int64))


def read_dbpedia_csv(path: str | os.PathLike) -> ClusteringData:
    """DBpedia-14 subsample: csv rows ``"label","text"``, no header, labels 1..14."""
    path = require_file(path, "DBpedia-14 csv")
    sentences, labels = [], []
    with path.open(encoding="utf-8", newline="") as f:
        for number, row in enumerate(csv.reader(f), start=1):
            if len(row) != 2 or not row[0].isdigit():
                raise ValueError(f"{path}: row {number}: expected 'label,text', got {row[:2]!r}")
            sentences.append(row[1].strip())
            labels.append(int(row[0]))
    return ClusteringData(sentences, np.array(labels, dtype=np.int64))


def read_agnews_csv(path: str | os.PathLike) -> ClusteringData:
    """AG News test csv ``class,title,description`` with a header row.

    The text is ``title + " " + description``; the corpus writes line breaks as a literal
    backslash, which becomes a space.
    """
    path = require_file(path, "AG News csv")
    with path.open(encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    if not rows or tuple(rows[0]) != AGNEWS_HEADER:
        raise ValueError(f"{path}: expected the header {AGNEWS_HEADER}, got {rows[:1]!r}")
    sentences, labels = [], []
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != 3 or not row[0].isdigit():
            raise ValueError(f"{path}: row {number}: expected 'class,title,description', got {row!r}")
        text = f"{row[1]} {row[2]}".replace("\\", " ")
        sentences.append(" ".join(text.split()))
        labels.append(int(row[0]))
    return ClusteringData(sentences, np.array(labels, dtype=np.int64))


def load_clustering_task(name: str, data_dir: str | os.PathLike | None = None) -> ClusteringData:
    """One clustering task by name (see ``CLUSTERING_TASKS``)."""
    if name not in CLUSTERING_FILES:
        raise ValueError(f"unknown clustering task {name!r}; choose from {', '.join(CLUSTERING_TASKS)}")
    path = resolve_data_dir(data_dir) / CLUSTERING_FILES[name]
    if name == "DBpedia":
        return read_dbpedia_csv(path)
    if name == "AgNewsFull":
        return read_agnews_csv(path)
    return read_short_text_file(path)
