"""K-means clustering evaluation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_sentemb.evaluation.clustering import cluster_scores, evaluate_clustering, kmeans_assign

from .conftest import hashed_bow


def two_blobs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 0.1, (20, 4)), rng.normal(5, 0.1, (20, 4))]).astype(np.float32)
    return x, np.array([7] * 20 + [9] * 20)


def test_well_separated_blobs_are_recovered_exactly():
    x, labels = two_blobs()
    result = cluster_scores(x, labels, runs=3, seed=0)
    assert (result["acc"], result["nmi"], result["ami"]) == (100.0, 1.0, 1.0)
    assert (result["acc_std"], result["n_clusters"], result["n"], result["runs"]) == (0.0, 2, 40, 3)


def test_kmeans_is_deterministic_for_a_seed():
    x = np.random.default_rng(1).standard_normal((60, 8)).astype(np.float32)
    assert np.array_equal(kmeans_assign(x, 4, seed=3), kmeans_assign(x, 4, seed=3))


def test_kmeans_rejects_more_clusters_than_points():
    with pytest.raises(ValueError, match="n_clusters=5 for 3 points"):
        kmeans_assign(np.zeros((3, 2), dtype=np.float32), 5, seed=0)


def test_clustering_suite_on_fixtures(eval_data: Path):
    results = evaluate_clustering(hashed_bow, eval_data, tasks=["Tweet", "DBpedia"], runs=2)
    assert list(results) == ["Tweet", "DBpedia"]
    for result in results.values():
        assert (result["n"], result["n_clusters"], result["runs"]) == (45, 3, 2)
        assert 33.33 <= result["acc"] <= 100 and -1 <= result["ami"] <= 1
