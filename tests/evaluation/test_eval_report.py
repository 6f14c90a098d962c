"""Report: paper layouts, averages, atomic files, and a small end-to-end run on fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lightning_sentemb.evaluation.analysis import analyze_sts_pairs, frequent_token_removal
from lightning_sentemb.evaluation.clustering import evaluate_clustering
from lightning_sentemb.evaluation.report import atomic_write_bytes, write_report
from lightning_sentemb.evaluation.transfer import evaluate_transfer

from .conftest import hashed_bow, keyword_encode

TRANSFER_HEADER = "| Model | MR | CR | SUBJ | MPQA | SST | TREC | MRPC | Avg. |"
CLUSTERING_HEADER = "| Model | AG | Bio | G-S | G-T | G-TS | SS | SO | Tweet | Avg. |"


def test_tables_follow_the_papers_and_average_only_complete_rows(tmp_path: Path):
    transfer = {
        task: {"acc": acc}
        for task, acc in zip(
            ["MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC"], [80.0, 85.0, 90.0, 88.0, 86.0, 84.0, 74.0],
            strict=True,
        )
    }
    clustering = {"AgNews": {"acc": 70.0, "nmi": 0.5, "ami": 0.4}, "DBpedia": {"acc": 60.0, "nmi": 0.6, "ami": 0.7355}}
    results = {"full": {"transfer": transfer, "clustering": clustering}, "partial": {"transfer": {"MR": {"acc": 70.0}}}}
    written = write_report(results, tmp_path)
    report = written["markdown"].read_text()
    assert TRANSFER_HEADER in report
    assert "| full | 80.00 | 85.00 | 90.00 | 88.00 | 86.00 | 84.00 | 74.00 | 83.86 |" in report  # 587 / 7
    assert "| partial | 70.00 | – | – | – | – | – | – | – |" in report
    assert CLUSTERING_HEADER in report
    assert "| full | 70.00 | – | – | – | – | – | – | – | – |" in report
    assert "| Model | DBpedia ACC | DBpedia NMI | DBpedia AMI |" in report
    assert "| full | 60.00 | 0.6000 | 0.7355 |" in report
    assert json.loads(written["json"].read_text()) == results


def test_atomic_write_leaves_no_temporary_file(tmp_path: Path):
    path = atomic_write_bytes(tmp_path / "sub" / "a.txt", b"one")
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two"
    assert [p.name for p in path.parent.iterdir()] == ["a.txt"]


def test_report_rejects_values_json_cannot_store(tmp_path: Path):
    with pytest.raises(TypeError, match="set"):
        write_report({"m": {"extra": {1, 2}}}, tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_end_to_end_report_on_fixtures(eval_data: Path, tmp_path: Path):
    first = [f"a man plays {w}" for w in ["guitar", "piano", "drums", "flute", "violin", "harp"]] * 2
    second = [f"someone plays {w}" for w in ["guitar", "piano", "drums", "flute", "violin", "harp"]] * 2
    gold = [0.0, 0.0, 3.0, 3.0, 5.0, 5.0, 4.5, 1.0, 2.0, 0.0, 3.0, 5.0]

    def sts_score(encode) -> float:  # stands in for the STS suite: Spearman-free, just deterministic
        a, b = np.asarray(encode(first)), np.asarray(encode(second))
        return float(np.mean(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-9)))

    results = {}
    for name, encode in (("keywords", keyword_encode), ("bag-of-words", hashed_bow)):
        results[name] = {
            "transfer": evaluate_transfer(
                encode, eval_data, tasks=["MR", "SST2", "MRPC"], kfold=2, shots=2, few_shot_seeds=(0, 1)
            ),
            "clustering": evaluate_clustering(encode, eval_data, tasks=["AgNews", "Tweet", "DBpedia"], runs=2),
            "analysis": analyze_sts_pairs(encode, first, second, gold, tmp_path / "work", name=name, pairs_per_group=2),
            "frequent_tokens": frequent_token_removal(lambda k, encode=encode: encode, sts_score, first + second,
                                                      ks=(0, 1, 2)),
        }
    out = tmp_path / "report"
    written = write_report(results, out)

    report = (out / "report.md").read_text()
    assert TRANSFER_HEADER in report and CLUSTERING_HEADER in report
    keywords = results["keywords"]["transfer"]
    assert f"| keywords | {keywords['MR']['acc']:.2f} | – | – | – | {keywords['SST2']['acc']:.2f} | – |" in report
    assert f"{keywords['MR']['few_shot']['mean']:.2f} ± {keywords['MR']['few_shot']['std']:.2f}" in report
    for section in (
        "## Alignment and uniformity",
        "## Predicted cosine per gold-score bucket",
        "## Removing the most frequent tokens",
        "### Few-shot transfer",
        "### DBpedia and AG News",
    ):
        assert section in report
    figures = sorted(p.name for p in (out / "figures").iterdir())
    assert figures == [
        "alignment_uniformity.png",
        "bag-of-words_cosine_distribution.png",
        "bag-of-words_tsne.png",
        "few_shot.png",
        "frequent_tokens.png",
        "keywords_cosine_distribution.png",
        "keywords_tsne.png",
    ]
    for name in figures:
        assert f"(figures/{name})" in report
        assert (out / "figures" / name).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    assert set(written) >= {"json", "markdown", "few_shot", "alignment_uniformity", "frequent_tokens"}
    assert not list(out.rglob(".*.tmp"))
