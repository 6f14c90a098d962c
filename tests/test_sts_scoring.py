import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from lightning_sentemb.data.senteval import StsTask
from lightning_sentemb.evaluation.sts import StsSpearman, evaluate_sts, sts_correlations

PRED = np.array([0.1, 0.4, 0.3, 0.9, 0.5, 0.2, 0.8])
GOLD = np.array([1.0, 2.0, 3.0, 4.0, 1.0, 0.0, 5.0])
SUBSETS = ["a", "a", "a", "a", "b", "b", "b"]


def test_all_concatenates_subsets_while_wmean_weights_subset_scores():
    scores = sts_correlations(PRED, GOLD, SUBSETS)
    # subset a: ranks of pred (1,3,2,4) vs gold (1,2,3,4): rho = 1 - 6*2/(4*15) = 0.8
    # subset b: pred (0.5,0.2,0.8) vs gold (1,0,5): identical order, rho = 1
    assert scores["subset/a"] == pytest.approx(80.0)
    assert scores["subset/b"] == pytest.approx(100.0)
    assert scores["wmean"] == pytest.approx((80.0 * 4 + 100.0 * 3) / 7)
    assert scores["mean"] == pytest.approx(90.0)
    assert scores["all"] == pytest.approx(100 * spearmanr(PRED, GOLD).correlation)
    assert scores["all"] != pytest.approx(scores["wmean"])


def test_streaming_metric_deduplicates_padded_pairs():
    metric = StsSpearman(["a", "b"], "wmean")
    subset = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    order = torch.tensor([3, 0, 6, 1, 5, 2, 4, 3, 0])  # a DDP sampler repeats pairs 3 and 0
    metric.update(order, torch.tensor(PRED)[order], torch.tensor(GOLD)[order], subset[order])
    expected = sts_correlations(PRED, GOLD, SUBSETS)["wmean"]
    assert metric.compute().item() == pytest.approx(expected, abs=1e-4)


def test_evaluate_sts_encodes_each_sentence_once():
    task = StsTask("T", ["x", "y", "x"], ["y", "z", "z"], np.array([1.0, 2.0, 3.0]), ["T"] * 3)
    vectors = {"x": [1.0, 0.0], "y": [1.0, 1.0], "z": [0.0, 1.0]}
    calls = []

    def encode(sentences):
        calls.append(list(sentences))
        return torch.tensor([vectors[s] for s in sentences])

    scores = evaluate_sts(encode, [task])
    assert calls == [["x", "y", "z"]]
    # cosines: x·y = .707, y·z = .707, x·z = 0 -> ranks (2.5, 2.5, 1) vs (1, 2, 3)
    assert scores["T"] == pytest.approx(100 * spearmanr([0.7071, 0.7071, 0.0], [1, 2, 3]).correlation, abs=1e-3)
    assert scores["avg"] == scores["T"]
