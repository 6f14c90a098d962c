"""K-means clustering of frozen embeddings (ConPVP Table 6, ClusterNS Tables 5-6).

K is the number of gold classes; K-means (faiss-cpu, on the CPU: the embeddings are already there,
and a GPU faiss would claim every GPU of the node, those other ranks train on included) runs
once per seed on the raw embeddings, and ACC / NMI / AMI are averaged over the runs.
faiss is told to use every point (its default subsamples to 256 points per centroid)
and to iterate up to ``niter`` times (it stops early once assignments settle). On the CPU
faiss runs single-threaded: on a busy 2-core machine its OpenMP threads made each run
about 5x slower, and these problems (at most 20k points) are small.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import faiss
import numpy as np
from threadpoolctl import threadpool_limits

from lightning_sentemb.data.clustering import CLUSTERING_TASKS, ClusteringData, load_clustering_task
from lightning_sentemb.evaluation.metrics import Encode, clustering_scores, encode_checked


def kmeans_assign(embeddings: np.ndarray, n_clusters: int, seed: int, niter: int = 100) -> np.ndarray:
    """Cluster id of each row after one K-means run with the given seed."""
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    if not 1 < n_clusters <= len(x):
        raise ValueError(f"K-means needs 1 < n_clusters <= n_points, got n_clusters={n_clusters} for {len(x)} points")
    kmeans = faiss.Kmeans(
        x.shape[1],
        n_clusters,
        niter=niter,
        seed=seed,
        max_points_per_centroid=len(x),
        min_points_per_centroid=1,
    )
    with threadpool_limits(limits=1):
        kmeans.train(x)
        _, assignment = kmeans.index.search(x, 1)
    return assignment[:, 0]


def cluster_scores(
    embeddings: np.ndarray, labels: np.ndarray, *, runs: int = 10, seed: int = 0, niter: int = 100
) -> dict:
    """Mean and population std of ACC (%), NMI and AMI over ``runs`` K-means seeds."""
    n_clusters = len(np.unique(labels))
    per_run = [
        clustering_scores(labels, kmeans_assign(embeddings, n_clusters, seed + run, niter)) for run in range(runs)
    ]
    result: dict = {"n": len(labels), "n_clusters": n_clusters, "runs": runs}
    for metric in ("acc", "nmi", "ami"):
        values = [scores[metric] for scores in per_run]
        digits = 2 if metric == "acc" else 4
        result[metric] = round(float(np.mean(values)), digits)
        result[f"{metric}_std"] = round(float(np.std(values)), digits)
    return result


def evaluate_clustering_data(
    encode: Encode, name: str, data: ClusteringData, *, runs: int = 10, seed: int = 0, niter: int = 100
) -> dict:
    """One task's scores; the sentences are encoded once and reused by every run."""
    start = time.perf_counter()
    embeddings = encode_checked(encode, data.sentences, name)
    encoded = time.perf_counter()
    result = cluster_scores(embeddings, data.labels, runs=runs, seed=seed, niter=niter)
    result["encode_seconds"] = round(encoded - start, 2)
    result["kmeans_seconds"] = round(time.perf_counter() - encoded, 2)
    return result


def evaluate_clustering(
    encode: Encode,
    data_dir: str | os.PathLike | None = None,
    tasks: Sequence[str] = CLUSTERING_TASKS,
    *,
    runs: int = 10,
    seed: int = 0,
    niter: int = 100,
) -> dict[str, dict]:
    """Clustering scores per task; keys as in ``CLUSTERING_TASKS``."""
    return {
        name: evaluate_clustering_data(
            encode, name, load_clustering_task(name, data_dir), runs=runs, seed=seed, niter=niter
        )
        for name in tasks
    }
