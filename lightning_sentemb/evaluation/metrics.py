"""Metrics shared by the evaluation suite, on plain numpy arrays.

Conventions follow the papers' tables: clustering accuracy in percent, NMI and AMI in [0, 1]
(ClusterNS Table 5 prints AMI as 0.7355), alignment and uniformity as in Wang & Isola (2020).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import adjusted_mutual_info_score, normalized_mutual_info_score

Encode = Callable[[list[str]], np.ndarray]


class TaskLabelledEncode:
    """An `Encode` whose progress bar names the task it is encoding: `encode_checked` labels each
    call "<evaluator>: <data set>"; any other caller gets the evaluator's name alone.
    `encode(sentences, label=...)` is `SentEmbMethod.encode` (or anything with its signature)."""

    def __init__(self, encode: Callable[..., np.ndarray], evaluator: str) -> None:
        self.encode, self.evaluator = encode, evaluator

    def __call__(self, sentences: list[str]) -> np.ndarray:
        return self.encode(sentences, label=self.evaluator)

    def for_task(self, what: str) -> Encode:
        return lambda sentences: self.encode(sentences, label=f"{self.evaluator}: {what}")


def encode_checked(encode: Encode, sentences: Sequence[str], what: str) -> np.ndarray:
    """Call ``encode`` once and check it returned one finite float32 row per sentence.

    A wrong shape from a user's encoder would otherwise surface as an obscure sklearn or
    faiss error far from its cause; ``what`` names the data set in the message.
    """
    if isinstance(encode, TaskLabelledEncode):
        encode = encode.for_task(what)
    embeddings = np.asarray(encode(list(sentences)), dtype=np.float32)
    if embeddings.ndim != 2 or embeddings.shape[0] != len(sentences):
        raise ValueError(
            f"encode returned shape {embeddings.shape} for {len(sentences)} sentences of {what}; "
            "expected (n_sentences, dim)"
        )
    if not np.isfinite(embeddings).all():
        raise ValueError(f"encode returned NaN or infinite values for {what}")
    return np.ascontiguousarray(embeddings)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length; all-zero rows stay zero instead of becoming NaN."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1, norms)


def clustering_accuracy(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Accuracy (%) after the best one-to-one mapping of clusters to classes (Hungarian)."""
    labels_true, labels_pred = np.asarray(labels_true), np.asarray(labels_pred)
    if labels_true.shape != labels_pred.shape or labels_true.ndim != 1 or labels_true.size == 0:
        raise ValueError(
            f"need two equal-length non-empty label vectors, got {labels_true.shape} and {labels_pred.shape}"
        )
    _, true_ids = np.unique(labels_true, return_inverse=True)
    _, pred_ids = np.unique(labels_pred, return_inverse=True)
    counts = np.zeros((pred_ids.max() + 1, true_ids.max() + 1), dtype=np.int64)
    np.add.at(counts, (pred_ids, true_ids), 1)
    rows, cols = linear_sum_assignment(counts, maximize=True)
    return 100.0 * counts[rows, cols].sum() / labels_true.size


def clustering_scores(labels_true: np.ndarray, labels_pred: np.ndarray) -> dict[str, float]:
    """ACC (%), NMI and AMI of one clustering against the gold classes."""
    return {
        "acc": clustering_accuracy(labels_true, labels_pred),
        "nmi": float(normalized_mutual_info_score(labels_true, labels_pred)),
        "ami": float(adjusted_mutual_info_score(labels_true, labels_pred)),
    }


def alignment(x: np.ndarray, y: np.ndarray) -> float:
    """Mean squared distance between normalized positive pairs (Wang & Isola, alpha = 2)."""
    if x.shape != y.shape or x.ndim != 2 or len(x) == 0:
        raise ValueError(f"alignment needs two equal-shape non-empty (n, d) arrays, got {x.shape} and {y.shape}")
    diff = l2_normalize(x.astype(np.float64)) - l2_normalize(y.astype(np.float64))
    return float(np.mean(np.sum(diff * diff, axis=1)))


def uniformity(x: np.ndarray, t: float = 2.0) -> float:
    """log E[exp(-t ||f(a) - f(b)||^2)] over all distinct pairs of normalized rows (lower is better)."""
    if x.ndim != 2 or len(x) < 2:
        raise ValueError(f"uniformity needs at least two rows of an (n, d) array, got {x.shape}")
    z = l2_normalize(x.astype(np.float64))
    sq_norms = np.sum(z * z, axis=1)
    total, block = 0.0, 1024  # row blocks keep memory at O(block * n), not O(n^2)
    for start in range(0, len(z) - 1, block):
        rows = slice(start, min(start + block, len(z)))
        sq_dist = sq_norms[rows, None] + sq_norms[None, :] - 2.0 * (z[rows] @ z.T)
        above_diagonal = np.arange(len(z))[None, :] > np.arange(rows.start, rows.stop)[:, None]
        total += float(np.sum(np.exp(-t * np.maximum(sq_dist, 0.0)), where=above_diagonal))
    n_pairs = len(z) * (len(z) - 1) / 2
    return float(np.log(total / n_pairs))


def paired_cosine(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cosine similarity of row i of ``x`` with row i of ``y``."""
    return np.sum(l2_normalize(x.astype(np.float64)) * l2_normalize(y.astype(np.float64)), axis=1)
