"""Transfer protocol: folds, C selection, MRPC features, few-shot draws, the whole suite on fixtures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_sentemb.data.transfer import LabelledPairs, LabelledSentences
from lightning_sentemb.evaluation.transfer import (
    INNER_KFOLD_CS,
    KFOLD_CS,
    _select_c,
    cross_validated_accuracy,
    embed_split,
    evaluate_transfer,
    evaluate_transfer_splits,
    few_shot_accuracy,
    senteval_order,
    transfer_folds,
)

from .conftest import keyword_encode


def test_c_grids_are_senteval_sklearn_grids():
    assert INNER_KFOLD_CS == (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    assert KFOLD_CS == (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def test_folds_are_deterministic_for_a_seed_and_partition_the_data():
    labels = np.array([0, 1] * 15)
    folds = transfer_folds(labels, kfold=5, seed=1111)
    again = transfer_folds(labels, kfold=5, seed=1111)
    other = transfer_folds(labels, kfold=5, seed=7)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(folds, again, strict=True))
    assert not all(np.array_equal(a[1], b[1]) for a, b in zip(folds, other, strict=True))
    assert sorted(np.concatenate([test for _, test in folds]).tolist()) == list(range(30))
    assert all(np.bincount(labels[test]).tolist() == [3, 3] for _, test in folds)  # stratified


def test_select_c_rounds_then_prefers_the_smaller_c():
    # fold means 0.80001 and 0.80004 both round to 80.0: SentEval's argmax keeps the first (smaller C)
    c, dev = _select_c((0.5, 1.0, 2.0), [[0.8, 0.80002, 0.7], [0.80002, 0.80006, 0.7]])
    assert (c, dev) == (0.5, 80.0)


def test_senteval_order_by_length_then_label():
    split = LabelledSentences(["a b c", "a", "b", "a b"], np.array([0, 1, 0, 1]))
    assert senteval_order(split).tolist() == [2, 1, 3, 0]


def test_mrpc_features_are_abs_difference_and_product():
    vectors = {"u": [1.0, -2.0], "v": [3.0, 1.0]}
    split = LabelledPairs(["u"], ["v"], np.array([1]))
    features, labels = embed_split(lambda s: np.array([vectors[x] for x in s]), split, "MRPC train")
    assert features.tolist() == [[2.0, 3.0, 3.0, -2.0]]
    assert labels.tolist() == [1]


def test_each_sentence_is_encoded_once_per_split():
    calls = []

    def counting_encode(sentences: list[str]) -> np.ndarray:
        calls.append(len(sentences))
        return keyword_encode(sentences)

    sentences = [f"excellent film {i}" for i in range(8)] + [f"terrible film {i}" for i in range(8)]
    split = LabelledSentences(sentences, np.array([1] * 8 + [0] * 8))
    evaluate_transfer_splits(counting_encode, "MR", {"all": split}, kfold=2, shots=2, few_shot_seeds=(0, 1))
    assert calls == [16]


def test_cross_validated_accuracy_on_separable_data_is_100():
    x = np.concatenate([np.full((10, 2), [1.0, 0.0]), np.full((10, 2), [0.0, 1.0])])
    x += np.random.default_rng(0).normal(0, 0.01, x.shape)
    result = cross_validated_accuracy(x, np.array([1] * 10 + [0] * 10), kfold=2, seed=1111)
    assert (result["acc"], result["devacc"], result["n_test"]) == (100.0, 100.0, 20)


def test_few_shot_draws_shots_per_class_and_scores_the_rest():
    x = np.arange(12, dtype=np.float64)[:, None]
    y = np.array([0] * 6 + [1] * 6)
    result = few_shot_accuracy((x, y), shots=2, seeds=(0, 1, 2))
    assert result["shots"] == 2 and len(result["accs"]) == 3
    assert result == few_shot_accuracy((x, y), shots=2, seeds=(0, 1, 2))  # same seeds, same draws
    assert result["mean"] == pytest.approx(np.mean(result["accs"]), abs=0.01)
    with pytest.raises(ValueError, match="needs 7 examples of class 0"):
        few_shot_accuracy((x, y), shots=7)


def test_whole_suite_on_fixtures(eval_data: Path):
    results = evaluate_transfer(keyword_encode, eval_data, kfold=3, shots=2, few_shot_seeds=(0, 1))
    assert list(results) == ["MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC"]
    for name, result in results.items():
        assert result["acc"] == 100.0, name  # every fixture class has its own keyword
        assert result["few_shot"]["accs"] == [100.0, 100.0], name
    assert results["MRPC"]["f1"] == 100.0
    assert (results["MR"]["n_train"], results["SST2"]["n_test"], results["TREC"]["n_train"]) == (40, 40, 120)


def test_unknown_split_layout_is_rejected():
    split = LabelledSentences(["a", "b"], np.array([0, 1]))
    with pytest.raises(ValueError, match="match no protocol"):
        evaluate_transfer_splits(keyword_encode, "X", {"train": split, "valid": split})
