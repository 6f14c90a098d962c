"""Embedding-space analyses against hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from lightning_sentemb.evaluation.analysis import (
    alignment_uniformity,
    analyze_sts_pairs,
    cosine_by_score_bucket,
    encode_pairs,
    frequent_token_removal,
    most_frequent_tokens,
    remove_tokens,
    tsne_pairs,
)

from .conftest import hashed_bow

VECTORS = {"a": [1.0, 0.0], "b": [1.0, 0.0], "c": [0.0, 1.0], "d": [-1.0, 0.0]}


def lookup_encode(sentences: list[str]) -> np.ndarray:
    return np.array([VECTORS[s] for s in sentences], dtype=np.float32)


def test_alignment_over_positives_uniformity_over_distinct_sentences():
    first, second, distinct = encode_pairs(lookup_encode, ["a", "a", "c"], ["b", "c", "d"])
    assert distinct.shape == (4, 2)  # a, c, b, d: "a" and "c" encoded once each
    result = alignment_uniformity(first, second, np.array([5.0, 4.5, 1.0]), distinct)
    # positives (gold > 4): (a, b) distance^2 0 and (a, c) distance^2 2 -> alignment 1
    assert result["alignment"] == 1.0
    # distinct a, c, b, d -> squared distances: a-c 2, a-b 0, a-d 4, c-b 2, c-d 2, b-d 4
    expected = math.log((math.exp(-4) + 1 + math.exp(-8) + 2 * math.exp(-4) + math.exp(-8)) / 6)
    assert result["uniformity"] == round(expected, 4)
    assert (result["n_positive_pairs"], result["n_sentences"]) == (2, 4)


def test_alignment_needs_a_positive_pair():
    first, second, distinct = encode_pairs(lookup_encode, ["a"], ["b"])
    with pytest.raises(ValueError, match="positive_threshold=4.0"):
        alignment_uniformity(first, second, np.array([3.0]), distinct)


def test_cosine_buckets_include_the_top_edge():
    cosines = np.array([0.1, 0.3, 0.9, 0.7])
    buckets = cosine_by_score_bucket(cosines, np.array([0.0, 0.5, 5.0, 4.0]))
    assert [b["n"] for b in buckets] == [2, 0, 0, 0, 2]
    assert buckets[0]["range"] == "0-1" and buckets[0]["mean"] == 0.2
    assert buckets[4]["range"] == "4-5" and buckets[4]["median"] == 0.8
    assert "mean" not in buckets[1]


def test_most_frequent_tokens_and_removal():
    corpus = ["The cat sat.", "the dog ran.", "A cat."]
    assert most_frequent_tokens(corpus, 3) == [".", "the", "cat"]
    assert remove_tokens("The cat, the  dog.", {"the", "."}) == "cat, dog"


def test_frequent_token_removal_feeds_the_scorer_the_stripped_text():
    captured = []

    def recording_encode(sentences: list[str]) -> np.ndarray:
        captured.append(list(sentences))
        return hashed_bow(sentences)

    passes = []

    def encode_pass(k: int):
        passes.append(k)
        return recording_encode

    result = frequent_token_removal(
        encode_pass,
        lambda enc: float(len(enc(["The cat sat .", "a dog"]))),
        ["the the cat .", "the ."],
        ks=(0, 1, 2),
    )
    assert result["ks"] == [0, 1, 2] and result["scores"] == [2.0, 2.0, 2.0]
    assert result["removed_tokens"] == ["the", "."]
    assert captured == [["The cat sat .", "a dog"], ["cat sat .", "a dog"], ["cat sat", "a dog"]]
    assert passes == [0, 1, 2]


def test_tsne_writes_a_png_and_uses_the_requested_groups(tmp_path: Path):
    first = hashed_bow([f"first sentence {i}" for i in range(9)])
    second = hashed_bow([f"second sentence {i}" for i in range(9)])
    scores = np.array([0, 0, 0, 3, 3, 3, 5, 5, 5], dtype=float)
    result = tsne_pairs(first, second, scores, tmp_path / "tsne.png", pairs_per_group=2, seed=0)
    assert Path(result["figure"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    groups = [int(scores[i]) for i in result["pair_indices"]]
    assert groups == [0, 0, 3, 3, 5, 5]
    with pytest.raises(ValueError, match="t-SNE group 0: 3 pairs within tolerance 0.0, need 4"):
        tsne_pairs(first, second, scores, tmp_path / "x.png", pairs_per_group=4)


def test_analyze_sts_pairs_writes_both_figures(tmp_path: Path):
    first = [f"a man plays {w}" for w in ["guitar", "piano", "drums", "flute", "violin", "harp"]] * 2
    second = [f"someone plays {w}" for w in ["guitar", "piano", "drums", "flute", "violin", "harp"]] * 2
    scores = [0.0, 0.0, 3.0, 3.0, 5.0, 5.0, 4.5, 1.0, 2.0, 0.0, 3.0, 5.0]
    result = analyze_sts_pairs(hashed_bow, first, second, scores, tmp_path, name="bow", pairs_per_group=2)
    assert set(result["figures"]) == {"cosine_distribution", "tsne"}
    assert all(Path(p).is_file() and Path(p).parent == tmp_path for p in result["figures"].values())
    assert result["n_positive_pairs"] == 4 and result["n_sentences"] == 12
    assert not list(tmp_path.glob(".*.tmp"))
