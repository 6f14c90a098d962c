"""Fixtures for the evaluation suite: a deterministic fake encoder and miniature data dirs
that reproduce each quirk of the real files (Latin-1, BOM, CRLF, trailing tabs, blank lines)."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

DIM = 64
POSITIVE = ["excellent", "superb", "wonderful", "great"]
NEGATIVE = ["terrible", "awful", "dreadful", "bad"]
TOPICS = [["guitar", "piano"], ["football", "tennis"], ["python", "java"]]
FILLER = ["the", "film", "plot", "cast", "was", "really", "quite", "a", "story", "music"]


def hashed_bow(sentences: list[str]) -> np.ndarray:
    """Sum of one fixed random vector per lower-cased token (seeded by its CRC32): deterministic."""
    out = np.zeros((len(sentences), DIM), dtype=np.float32)
    for i, sentence in enumerate(sentences):
        for token in sentence.lower().split():
            out[i] += np.random.default_rng(zlib.crc32(token.encode())).standard_normal(DIM).astype(np.float32)
    return out


KEYWORD_GROUPS = [
    POSITIVE,
    NEGATIVE,
    *([w] for w in ["abbreviation", "describe", "thing", "who", "where", "many", "unrelated"]),
    *TOPICS,
]


def keyword_encode(sentences: list[str]) -> np.ndarray:
    """Per class-word group, how many of its words a sentence has, plus a little hashed noise:
    every fixture class sits at its own corner, so any sane classifier or K-means is exact."""
    counts = np.array(
        [[sum(s.split().count(w) for w in group) for group in KEYWORD_GROUPS] for s in sentences], dtype=np.float32
    )
    return np.concatenate([counts, 0.05 * hashed_bow(sentences)], axis=1)


@pytest.fixture()
def fake_encode():
    return hashed_bow


def labelled_sentences(n: int, seed: int, topics: list[list[str]]) -> tuple[list[str], list[int]]:
    """``n`` sentences per topic: one topic word among filler words, label = topic index."""
    rng = np.random.default_rng(seed)
    sentences, labels = [], []
    for label, words in enumerate(topics):
        for _ in range(n):
            filler = rng.choice(FILLER, size=3, replace=False).tolist()
            sentences.append(" ".join([*filler[:2], str(rng.choice(words)), filler[2]]))
            labels.append(label)
    return sentences, labels


def write_transfer_fixture(root: Path, n: int = 20) -> Path:
    """All seven transfer tasks in SentEval's layout, ``n`` examples per class and split."""
    downstream = root / "senteval" / "downstream"
    pos, _ = labelled_sentences(n, 1, [POSITIVE])
    neg, _ = labelled_sentences(n, 2, [NEGATIVE])
    for task, (name1, name0) in {
        "MR": ("rt-polarity.pos", "rt-polarity.neg"),
        "CR": ("custrev.pos", "custrev.neg"),
        "SUBJ": ("subj.objective", "subj.subjective"),
        "MPQA": ("mpqa.pos", "mpqa.neg"),
    }.items():
        (downstream / task).mkdir(parents=True)
        (downstream / task / name1).write_text("\n".join(pos) + "\n", encoding="latin-1")
        (downstream / task / name0).write_text("\n".join(neg) + "\n", encoding="latin-1")
    sst = downstream / "SST" / "binary"
    sst.mkdir(parents=True)
    for split, seed in (("train", 3), ("dev", 4), ("test", 5)):
        sentences, labels = labelled_sentences(n, seed, [NEGATIVE, POSITIVE])
        (sst / f"sentiment-{split}").write_text(
            "".join(f"{s} \t{y}\n" for s, y in zip(sentences, labels, strict=True)), encoding="utf-8"
        )
    trec = downstream / "TREC"
    trec.mkdir(parents=True)
    questions = [["abbreviation"], ["describe"], ["thing"], ["who"], ["where"], ["many"]]
    coarse = ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]
    for name, seed in (("train_5500.label", 6), ("TREC_10.label", 7)):
        sentences, labels = labelled_sentences(n, seed, questions)
        lines = [f"{coarse[y]}:fine {s} ?" for s, y in zip(sentences, labels, strict=True)]
        (trec / name).write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    mrpc = downstream / "MRPC"
    mrpc.mkdir(parents=True)
    for name, seed in (("msr_paraphrase_train.txt", 8), ("msr_paraphrase_test.txt", 9)):
        first, labels = labelled_sentences(n, seed, [NEGATIVE, POSITIVE])
        second = [s if y else s.replace(s.split()[2], "unrelated") for s, y in zip(first, labels, strict=True)]
        lines = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        lines += [f"{y}\t{i}\t{i + 1000}\t{a}\t{b}"
                  for i, (a, b, y) in enumerate(zip(first, second, labels, strict=True))]
        (mrpc / name).write_bytes(b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode("utf-8"))
    return root


def write_clustering_fixture(root: Path, n: int = 15) -> Path:
    """Every clustering task in the data-dir layout, three well-separated topics each."""
    short = root / "clustering" / "short_text" / "data"
    files = {
        "agnewsdataraw-8000": "\n",
        "biomedical/biomedical_true_text": "\r\n",
        "S": "\n",
        "T": "\n",
        "TS": "\n",
        "search_snippets/search_snippets_true_text": "\r\n",
        "stackoverflow/stackoverflow_true_text": "\t\r\n",
        "tweet-original-order.txt": "\r\n",
    }
    for i, (name, line_end) in enumerate(files.items()):
        sentences, labels = labelled_sentences(n, 10 + i, TOPICS)
        path = short / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(line_end.join(f"{y + 1}\t{s}" for s, y in zip(sentences, labels, strict=True)).encode("utf-8"))
    sentences, labels = labelled_sentences(n, 30, TOPICS)
    (root / "clustering" / "dbpedia14_subsample").mkdir(parents=True)
    (root / "clustering" / "dbpedia14_subsample" / "test.csv").write_text(
        "".join(f'"{y + 1}","{s}, indeed"\n' for s, y in zip(sentences, labels, strict=True)), encoding="utf-8"
    )
    (root / "clustering" / "agnews_full_test").mkdir(parents=True)
    (root / "clustering" / "agnews_full_test" / "test.csv").write_text(
        "Class Index,Title,Description\n"
        + "".join(f'{y + 1},"{s}","more\\words"\n' for s, y in zip(sentences, labels, strict=True)),
        encoding="utf-8",
    )
    return root


@pytest.fixture(scope="session")
def eval_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval_data")
    write_transfer_fixture(root)
    write_clustering_fixture(root)
    return root
