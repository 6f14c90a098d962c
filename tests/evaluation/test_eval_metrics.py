"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_sentemb.evaluation.metrics import (
    alignment,
    clustering_accuracy,
    clustering_scores,
    encode_checked,
    l2_normalize,
    paired_cosine,
    uniformity,
)


def test_clustering_accuracy_hand_example():
    # contingency (pred x true): p0={t1:1}, p1={t0:2}, p2={t1:1, t2:2}; best map p1->t0, p2->t2, p0->t1 = 5 of 6
    true = np.array([0, 0, 1, 1, 2, 2])
    pred = np.array([1, 1, 0, 2, 2, 2])
    assert clustering_accuracy(true, pred) == pytest.approx(500 / 6)


def test_clustering_accuracy_of_a_permuted_labelling_is_100():
    true = np.array([3, 3, 1, 1, 7, 7, 7])
    pred = np.array([0, 0, 2, 2, 1, 1, 1])
    assert clustering_accuracy(true, pred) == 100.0


def test_clustering_accuracy_with_more_clusters_than_classes():
    # one class split in two clusters: only one of them can map to it -> 3 of 4
    assert clustering_accuracy(np.array([0, 0, 1, 1]), np.array([0, 1, 2, 2])) == 75.0


def test_clustering_accuracy_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="equal-length"):
        clustering_accuracy(np.array([0, 1]), np.array([0]))


def test_ami_and_nmi_of_identical_labellings_are_1():
    labels = np.array([0, 0, 1, 1, 2, 2, 2])
    scores = clustering_scores(labels, labels + 10)  # same partition, other ids
    assert scores["ami"] == pytest.approx(1.0)
    assert scores["nmi"] == pytest.approx(1.0)
    assert scores["acc"] == 100.0


def test_nmi_hand_example():
    # MI = ln 2 (pred determines true); H(true) = ln 2; H(pred) = 1.5 ln 2; arithmetic mean = 1.25 ln 2
    scores = clustering_scores(np.array([0, 0, 1, 1]), np.array([0, 0, 1, 2]))
    assert scores["nmi"] == pytest.approx(0.8)


def test_alignment_hand_example():
    # normalized pairs: identical (distance^2 0) and orthogonal (distance^2 2): mean 1
    x = np.array([[2.0, 0.0], [0.0, 5.0]])
    y = np.array([[1.0, 0.0], [3.0, 0.0]])
    assert alignment(x, y) == pytest.approx(1.0)


def test_uniformity_hand_example():
    # e1, -e1, e2: squared distances 4, 2, 2 -> log((e^-8 + 2 e^-4) / 3)
    x = np.array([[1.0, 0.0], [-3.0, 0.0], [0.0, 0.5]])
    assert uniformity(x) == pytest.approx(math.log((math.exp(-8) + 2 * math.exp(-4)) / 3))


def test_uniformity_blocks_match_the_direct_formula():
    x = np.random.default_rng(0).standard_normal((1500, 8))  # more rows than one block
    z = l2_normalize(x)
    sq = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1)[np.triu_indices(len(z), k=1)]
    assert uniformity(x) == pytest.approx(math.log(np.mean(np.exp(-2 * sq))))


def test_paired_cosine_and_zero_rows():
    x = np.array([[1.0, 1.0], [0.0, 0.0]])
    y = np.array([[1.0, 0.0], [1.0, 0.0]])
    assert paired_cosine(x, y) == pytest.approx([math.sqrt(0.5), 0.0])


def test_encode_checked_names_the_data_on_a_wrong_shape():
    with pytest.raises(ValueError, match=r"shape \(2, 3\) for 3 sentences of MR"):
        encode_checked(lambda s: np.zeros((2, 3)), ["a", "b", "c"], "MR")
    with pytest.raises(ValueError, match="NaN"):
        encode_checked(lambda s: np.full((1, 3), np.nan), ["a"], "CR")
    assert encode_checked(lambda s: np.ones((1, 3), dtype=np.float64), ["a"], "CR").dtype == np.float32
