"""The real data directory: counts as published, one subsampled task end to end (skips without data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_sentemb.data.clustering import CLUSTERING_TASKS, ClusteringData, load_clustering_task
from lightning_sentemb.data.transfer import TRANSFER_TASKS, LabelledSentences, load_transfer_task
from lightning_sentemb.evaluation.clustering import evaluate_clustering_data
from lightning_sentemb.evaluation.transfer import evaluate_transfer_splits

from .conftest import hashed_bow

# SentEval's published sizes (CR and MPQA include their blank lines, as SentEval keeps them).
TRANSFER_SIZES = {
    "MR": {"all": 10662},
    "CR": {"all": 3775},
    "SUBJ": {"all": 10000},
    "MPQA": {"all": 10606},
    "SST2": {"train": 67349, "dev": 872, "test": 1821},
    "TREC": {"train": 5452, "test": 500},
    "MRPC": {"train": 4076, "test": 1725},
}
CLUSTERING_SIZES = {
    "AgNews": (8000, 4),
    "Biomedical": (20000, 20),
    "GoogleNews-S": (11108, 152),
    "GoogleNews-T": (11108, 152),
    "GoogleNews-TS": (11109, 152),
    "SearchSnippets": (12340, 8),
    "StackOverflow": (20000, 20),
    "Tweet": (2472, 89),
    "DBpedia": (5000, 14),
    "AgNewsFull": (7600, 4),
}


@pytest.mark.data
def test_every_task_has_its_published_size(shared_data: Path):
    for name in TRANSFER_TASKS:
        splits = load_transfer_task(name, shared_data)
        assert {key: len(split.labels) for key, split in splits.items()} == TRANSFER_SIZES[name], name
    for name in CLUSTERING_TASKS:
        data = load_clustering_task(name, shared_data)
        assert (len(data.sentences), len(np.unique(data.labels))) == CLUSTERING_SIZES[name], name
    assert load_transfer_task("MRPC", shared_data)["train"].first[0].startswith("Amrozi accused")  # BOM row dropped


@pytest.mark.data
def test_subsampled_mr_and_tweet_end_to_end(shared_data: Path):
    mr = load_transfer_task("MR", shared_data)["all"]
    keep = np.concatenate([np.flatnonzero(mr.labels == label)[:150] for label in (0, 1)])
    sample = LabelledSentences([mr.sentences[i] for i in keep], mr.labels[keep])
    result = evaluate_transfer_splits(hashed_bow, "MR", {"all": sample}, kfold=3, few_shot_seeds=(0, 1))
    assert result["n_train"] == 300 and 40 <= result["acc"] <= 100

    tweet = load_clustering_task("Tweet", shared_data)
    keep = np.flatnonzero(np.isin(tweet.labels, np.unique(tweet.labels)[:10]))
    subset = ClusteringData([tweet.sentences[i] for i in keep], tweet.labels[keep])
    scores = evaluate_clustering_data(hashed_bow, "Tweet", subset, runs=2)
    assert scores["n_clusters"] == 10 and scores["acc"] >= 10
