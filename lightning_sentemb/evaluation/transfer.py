"""SentEval transfer tasks on frozen embeddings (ConPVP Table 5, ClusterNS Table 8).

The protocol is SentEval's scikit-learn path (``usepytorch=False``), task by task:

* MR, CR, SUBJ, MPQA: k-fold cross-validation (k = 10 as in SimCSE's evaluation script);
  inside each outer fold the L2 penalty C is chosen by an inner k-fold over 2^-2 .. 2^3
  (SentEval's ``InnerKFoldClassifier``).
* TREC, MRPC: C chosen by k-fold on train over 2^-1 .. 2^5, refit on train, scored on
  test (``KFoldClassifier``). MRPC features are ``[|u - v|, u * v]``, as in SentEval's
  ``mrpc.py`` (``[u, v, |u - v|, u * v]`` is SentEval's SICK/SNLI choice, not MRPC's).
* SST-2: C chosen on dev over 2^-2 .. 2^3, scored on test (``SplitClassifier``).

Ties between C values go to the smaller C after rounding the accuracy to 2 decimals,
and examples are put in SentEval's order (by token count, then label) before the folds
are drawn, so the folds are those SentEval draws for the same seed.

Differences from SentEval, for speed on small CPUs: the classifier is scikit-learn's
current default (lbfgs, multinomial) rather than the 2017 default (liblinear,
one-vs-rest); the fits along the C grid warm-start from the previous C; BLAS runs
single-threaded (on 2 cores the threaded BLAS was several times slower on these small
problems); outer folds can run in parallel processes (``n_jobs``).

Few-shot (ConPVP Fig. 7): ``shots`` examples per class drawn from the training pool
(the whole set for the cross-validated tasks, scored on the remaining examples; the
train split otherwise, scored on test), logistic regression with a fixed C, one draw per
seed, mean and population std over seeds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np
from joblib import Parallel, delayed
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.model_selection import StratifiedKFold
from threadpoolctl import threadpool_limits

from lightning_sentemb.data.transfer import (
    TRANSFER_TASKS,
    LabelledPairs,
    LabelledSentences,
    TransferSplits,
    load_transfer_task,
)
from lightning_sentemb.evaluation import SENTEVAL_KFOLD
from lightning_sentemb.evaluation.metrics import Encode, encode_checked

INNER_KFOLD_CS: tuple[float, ...] = tuple(2.0**t for t in range(-2, 4))
KFOLD_CS: tuple[float, ...] = tuple(2.0**t for t in range(-1, 6))
SPLIT_CS: tuple[float, ...] = tuple(2.0**t for t in range(-2, 4))
MAX_ITER = 1000

Features = tuple[np.ndarray, np.ndarray]  # (x, y)


def senteval_order(split: LabelledSentences | LabelledPairs) -> np.ndarray:
    """Permutation SentEval applies before encoding: by token count(s), then label (stable)."""
    if isinstance(split, LabelledPairs):
        keys = [(len(a.split()), len(b.split()), int(y))
                for a, b, y in zip(split.first, split.second, split.labels, strict=True)]
    else:
        keys = [(len(s.split()), int(y)) for s, y in zip(split.sentences, split.labels, strict=True)]
    return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def embed_split(encode: Encode, split: LabelledSentences | LabelledPairs, what: str) -> Features:
    """Features and labels of one split, in SentEval's order; each sentence is encoded once."""
    order = senteval_order(split)
    if isinstance(split, LabelledPairs):
        sentences = [split.first[i] for i in order] + [split.second[i] for i in order]
        embeddings = encode_checked(encode, sentences, what)
        u, v = embeddings[: len(order)], embeddings[len(order) :]
        return np.concatenate([np.abs(u - v), u * v], axis=1), split.labels[order]
    return encode_checked(encode, [split.sentences[i] for i in order], what), split.labels[order]


def transfer_folds(labels: np.ndarray, kfold: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """SentEval's stratified, shuffled folds: deterministic for a given seed."""
    splitter = StratifiedKFold(n_splits=kfold, shuffle=True, random_state=seed)
    return list(splitter.split(np.zeros(len(labels)), labels))


def _classifier(c: float, seed: int, warm_start: bool = False) -> LogisticRegression:
    return LogisticRegression(C=c, random_state=seed, max_iter=MAX_ITER, warm_start=warm_start)


def _accuracy_path(
    x_train: np.ndarray, y_train: np.ndarray, evals: Sequence[Features], cs: Sequence[float], seed: int
) -> list[list[float]]:
    """Accuracy on each eval set for each C (ascending), warm-starting each fit from the last."""
    with threadpool_limits(limits=1):
        clf = _classifier(cs[0], seed, warm_start=True)
        scores = []
        for c in cs:
            clf.set_params(C=c).fit(x_train, y_train)
            scores.append([clf.score(x, y) for x, y in evals])
    return scores


def _select_c(cs: Sequence[float], fold_scores: Sequence[Sequence[float]]) -> tuple[float, float]:
    """SentEval's choice: best mean accuracy (%) rounded to 2 decimals, first (smallest C) on ties."""
    means = [round(100 * float(np.mean(column)), 2) for column in np.asarray(fold_scores).T]
    best = int(np.argmax(means))
    return cs[best], means[best]


def _outer_fold(
    x: np.ndarray, y: np.ndarray, train: np.ndarray, test: np.ndarray, kfold: int, seed: int
) -> tuple[float, float]:
    x_train, y_train = x[train], y[train]
    inner = [
        [row[0] for row in _accuracy_path(x_train[a], y_train[a], [(x_train[b], y_train[b])], INNER_KFOLD_CS, seed)]
        for a, b in transfer_folds(y_train, kfold, seed)
    ]
    c, devacc = _select_c(INNER_KFOLD_CS, inner)
    with threadpool_limits(limits=1):
        clf = _classifier(c, seed).fit(x_train, y_train)
    return devacc, round(100 * clf.score(x[test], y[test]), 2)


def cross_validated_accuracy(
    x: np.ndarray, y: np.ndarray, *, kfold: int = SENTEVAL_KFOLD, seed: int = 1111, n_jobs: int = 1
) -> dict:
    """MR/CR/SUBJ/MPQA protocol: outer k-fold test accuracy, C picked by inner k-fold."""
    folds = transfer_folds(y, kfold, seed)
    per_fold = Parallel(n_jobs=n_jobs)(delayed(_outer_fold)(x, y, train, test, kfold, seed) for train, test in folds)
    dev, test = zip(*per_fold, strict=True)
    return {
        "acc": round(float(np.mean(test)), 2),
        "devacc": round(float(np.mean(dev)), 2),
        "n_train": len(y),
        "n_test": len(y),
    }


def train_test_accuracy(
    train: Features, test: Features, *, kfold: int = SENTEVAL_KFOLD, seed: int = 1111, n_jobs: int = 1
) -> tuple[dict, np.ndarray]:
    """TREC/MRPC protocol: C picked by k-fold on train, refit on all of train, scored on test.

    Returns the result and the test predictions (MRPC also reports F1 from them).
    """
    (x_train, y_train), (x_test, y_test) = train, test
    per_fold = Parallel(n_jobs=n_jobs)(
        delayed(_accuracy_path)(x_train[a], y_train[a], [(x_train[b], y_train[b])], KFOLD_CS, seed)
        for a, b in transfer_folds(y_train, kfold, seed)
    )
    c, devacc = _select_c(KFOLD_CS, [[row[0] for row in fold] for fold in per_fold])
    with threadpool_limits(limits=1):
        predictions = _classifier(c, seed).fit(x_train, y_train).predict(x_test)
    acc = round(100 * float(np.mean(predictions == y_test)), 2)
    return {"acc": acc, "devacc": devacc, "n_train": len(y_train), "n_test": len(y_test)}, predictions


def dev_test_accuracy(train: Features, dev: Features, test: Features, *, seed: int = 1111) -> dict:
    """SST-2 protocol: C picked on dev, the classifier of that C scored on test."""
    path = _accuracy_path(*train, [dev, test], SPLIT_CS, seed)
    c, devacc = _select_c(SPLIT_CS, [[dev_score for dev_score, _ in path]])
    test_score = path[SPLIT_CS.index(c)][1]
    return {"acc": round(100 * test_score, 2), "devacc": devacc, "n_train": len(train[1]), "n_test": len(test[1])}


def few_shot_accuracy(
    pool: Features,
    test: Features | None = None,
    *,
    shots: int = 16,
    seeds: Sequence[int] = tuple(range(10)),
    c: float = 1.0,
) -> dict:
    """Accuracy (%) with ``shots`` labelled examples per class, one random draw per seed.

    Without ``test`` the examples of the pool that were not drawn are the test set.
    """
    x_pool, y_pool = pool
    classes = np.unique(y_pool)
    for label in classes:
        if np.sum(y_pool == label) < shots:
            raise ValueError(
                f"few-shot needs {shots} examples of class {label}, the pool has {np.sum(y_pool == label)}"
            )
    accs = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        drawn = np.concatenate([rng.choice(np.flatnonzero(y_pool == label), shots, replace=False) for label in classes])
        x_test, y_test = test if test is not None else (np.delete(x_pool, drawn, axis=0), np.delete(y_pool, drawn))
        with threadpool_limits(limits=1):
            clf = _classifier(c, seed).fit(x_pool[drawn], y_pool[drawn])
        accs.append(round(100 * clf.score(x_test, y_test), 2))
    return {"mean": round(float(np.mean(accs)), 2), "std": round(float(np.std(accs)), 2), "accs": accs, "shots": shots}


def evaluate_transfer_splits(
    encode: Encode,
    name: str,
    splits: TransferSplits,
    *,
    kfold: int = SENTEVAL_KFOLD,
    seed: int = 1111,
    few_shot: bool = True,
    shots: int = 16,
    few_shot_seeds: Sequence[int] = tuple(range(10)),
    n_jobs: int = 1,
) -> dict:
    """One task's result; the protocol follows from its splits ({all} / {train,dev,test} / {train,test})."""
    start = time.perf_counter()
    features = {key: embed_split(encode, split, f"{name} {key}") for key, split in splits.items()}
    encoded = time.perf_counter()
    if set(features) == {"all"}:
        result = cross_validated_accuracy(*features["all"], kfold=kfold, seed=seed, n_jobs=n_jobs)
        pool, test = features["all"], None
    elif set(features) == {"train", "dev", "test"}:
        result = dev_test_accuracy(features["train"], features["dev"], features["test"], seed=seed)
        pool, test = features["train"], features["test"]
    elif set(features) == {"train", "test"}:
        result, predictions = train_test_accuracy(
            features["train"], features["test"], kfold=kfold, seed=seed, n_jobs=n_jobs
        )
        if isinstance(splits["test"], LabelledPairs):
            result["f1"] = round(100 * float(f1_score(features["test"][1], predictions)), 2)
        pool, test = features["train"], features["test"]
    else:
        raise ValueError(
            f"{name}: splits {sorted(splits)} match no protocol; expected all | train,dev,test | train,test"
        )
    if few_shot:
        result["few_shot"] = few_shot_accuracy(pool, test, shots=shots, seeds=few_shot_seeds)
    result["encode_seconds"] = round(encoded - start, 2)
    result["classifier_seconds"] = round(time.perf_counter() - encoded, 2)
    return result


def evaluate_transfer(
    encode: Encode,
    data_dir: str | os.PathLike | None = None,
    tasks: Sequence[str] = TRANSFER_TASKS,
    *,
    kfold: int = SENTEVAL_KFOLD,
    seed: int = 1111,
    few_shot: bool = True,
    shots: int = 16,
    few_shot_seeds: Sequence[int] = tuple(range(10)),
    n_jobs: int = 1,
) -> dict[str, dict]:
    """Transfer accuracy (%) per task, plus few-shot mean/std; keys as in ``TRANSFER_TASKS``."""
    return {
        name: evaluate_transfer_splits(
            encode,
            name,
            load_transfer_task(name, data_dir),
            kfold=kfold,
            seed=seed,
            few_shot=few_shot,
            shots=shots,
            few_shot_seeds=few_shot_seeds,
            n_jobs=n_jobs,
        )
        for name in tasks
    }
