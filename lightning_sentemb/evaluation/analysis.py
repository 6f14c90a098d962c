"""Embedding-space analyses on STS pairs (ClusterNS §7, ConPVP §4.4-4.6).

* alignment / uniformity (Wang & Isola 2020): alignment over pairs with gold score above a
  threshold (> 4 on STS-B, as SimCSE and ClusterNS), uniformity over all distinct sentences;
* distribution of the predicted cosine per gold-score bucket (ConPVP Fig. 4);
* t-SNE of pairs grouped by gold score (ConPVP Fig. 6: scores 0, 3, 5; 10 pairs each);
* average STS with the k most frequent tokens removed (ConPVP Fig. 5).

The frequent-token analysis removes the tokens from the text before encoding: ``encode``
is a black box here, so the tokens' embeddings cannot be left out of the pooling as Yan
et al. (2021) do. Tokens are lower-cased words and punctuation marks.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from sklearn.manifold import TSNE

from lightning_sentemb.evaluation.figures import safe_filename, save_figure
from lightning_sentemb.evaluation.metrics import (
    Encode,
    alignment,
    encode_checked,
    l2_normalize,
    paired_cosine,
    uniformity,
)

SCORE_BUCKET_EDGES: tuple[float, ...] = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
FREQUENT_KS = (0, 5, 10, 15, 20)  # ConPVP Fig. 5: STS without the k most frequent tokens
TSNE_GROUPS: tuple[float, ...] = (0.0, 3.0, 5.0)
TSNE_COLORS: tuple[str, ...] = ("tab:orange", "tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown")
TOKEN_PATTERN = re.compile(r"\w+|[^\w\s]")


def _check_pairs(first: Sequence[str], second: Sequence[str], scores: Sequence[float]) -> np.ndarray:
    if not len(first) == len(second) == len(scores) or len(first) == 0:
        raise ValueError(
            "need equal, non-zero numbers of first sentences, second sentences and scores, "
            f"got {len(first)}, {len(second)} and {len(scores)}"
        )
    return np.asarray(scores, dtype=np.float64)


def encode_pairs(
    encode: Encode, first: Sequence[str], second: Sequence[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Embeddings of both sides and of the distinct sentences, each distinct sentence encoded once."""
    distinct = list(dict.fromkeys([*first, *second]))
    embeddings = encode_checked(encode, distinct, "the STS pairs")
    row = {sentence: i for i, sentence in enumerate(distinct)}
    return embeddings[[row[s] for s in first]], embeddings[[row[s] for s in second]], embeddings


def alignment_uniformity(
    first: np.ndarray, second: np.ndarray, scores: np.ndarray, distinct: np.ndarray, *, positive_threshold: float = 4.0
) -> dict:
    """Alignment over pairs with gold score > ``positive_threshold``; uniformity over ``distinct``."""
    positive = np.asarray(scores) > positive_threshold
    if not positive.any():
        raise ValueError(f"no pair has a gold score above positive_threshold={positive_threshold}")
    return {
        "alignment": round(alignment(first[positive], second[positive]), 4),
        "uniformity": round(uniformity(distinct), 4),
        "n_positive_pairs": int(positive.sum()),
        "n_sentences": len(distinct),
    }


def _bucket_index(scores: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """Bucket of each score: [e0, e1), [e1, e2), ..., [e_{n-1}, e_n] (the top edge included)."""
    return np.clip(np.searchsorted(edges, scores, side="right") - 1, 0, len(edges) - 2)


def cosine_by_score_bucket(
    cosines: np.ndarray, scores: np.ndarray, edges: Sequence[float] = SCORE_BUCKET_EDGES
) -> list[dict]:
    """Summary of the predicted cosine within each gold-score bucket (empty buckets have n = 0)."""
    buckets = _bucket_index(np.asarray(scores), edges)
    summary = []
    for b in range(len(edges) - 1):
        values = cosines[buckets == b]
        entry: dict = {"range": f"{edges[b]:g}-{edges[b + 1]:g}", "n": int(values.size)}
        if values.size:
            q25, median, q75 = np.percentile(values, [25, 50, 75])
            entry.update(
                mean=round(float(values.mean()), 4),
                std=round(float(values.std()), 4),
                q25=round(float(q25), 4),
                median=round(float(median), 4),
                q75=round(float(q75), 4),
            )
        summary.append(entry)
    return summary


def plot_cosine_by_score_bucket(
    cosines: np.ndarray,
    scores: np.ndarray,
    png_path: str | os.PathLike,
    *,
    edges: Sequence[float] = SCORE_BUCKET_EDGES,
    title: str = "",
) -> Path:
    """Box plot of the predicted cosine for each gold-score bucket."""
    buckets = _bucket_index(np.asarray(scores), edges)
    present = [b for b in range(len(edges) - 1) if np.any(buckets == b)]
    fig = Figure(figsize=(5, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.boxplot([cosines[buckets == b] for b in present], positions=range(len(present)))
    ax.set_xticks(range(len(present)), [f"{edges[b]:g}-{edges[b + 1]:g}" for b in present])
    ax.set_xlabel("gold score")
    ax.set_ylabel("predicted cosine")
    ax.set_title("Predicted cosine per gold score" + (f"\n{title}" if title else ""), pad=10)
    fig.legend(handles=[Line2D([], [], color="C1", label="median"),
                        Patch(facecolor="none", edgecolor="black", label="middle 50 % of pairs")],
               loc="outside lower center", ncol=2, fontsize=8)
    return save_figure(fig, png_path)


def tsne_pairs(
    first: np.ndarray,
    second: np.ndarray,
    scores: np.ndarray,
    png_path: str | os.PathLike,
    *,
    groups: Sequence[float] = TSNE_GROUPS,
    pairs_per_group: int = 10,
    tolerance: float = 0.0,
    seed: int = 0,
    title: str = "",
) -> dict:
    """t-SNE of ``pairs_per_group`` random pairs per gold score (within ``tolerance``), pairs joined by a line.

    Embeddings are L2-normalized first, so distances reflect the cosine the STS score uses.
    Exact t-SNE: for the ~60 points of the figure it is faster than Barnes-Hut, whose
    OpenMP threads stall on a busy 2-core machine.
    """
    if len(groups) > len(TSNE_COLORS):
        raise ValueError(f"at most {len(TSNE_COLORS)} t-SNE groups, got {len(groups)}")
    rng = np.random.default_rng(seed)
    chosen = []
    for score in groups:
        candidates = np.flatnonzero(np.abs(np.asarray(scores) - score) <= tolerance)
        if len(candidates) < pairs_per_group:
            raise ValueError(
                f"t-SNE group {score:g}: {len(candidates)} pairs within tolerance {tolerance}, need {pairs_per_group}"
            )
        chosen.append(rng.choice(candidates, pairs_per_group, replace=False))
    pairs = np.concatenate(chosen)
    points = l2_normalize(np.concatenate([first[pairs], second[pairs]]).astype(np.float64))
    perplexity = min(30.0, (len(points) - 1) / 3)
    coords = TSNE(n_components=2, perplexity=perplexity, init="pca", method="exact", random_state=seed).fit_transform(
        points
    )
    a, b = coords[: len(pairs)], coords[len(pairs) :]
    fig = Figure(figsize=(4.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    for g, score in enumerate(groups):
        rows = slice(g * pairs_per_group, (g + 1) * pairs_per_group)
        for (x0, y0), (x1, y1) in zip(a[rows], b[rows], strict=True):
            ax.plot([x0, x1], [y0, y1], color=TSNE_COLORS[g], linewidth=0.8, alpha=0.6)
        ax.scatter(*np.concatenate([a[rows], b[rows]]).T, color=TSNE_COLORS[g], s=14, label=f"{score:g}")
    ax.legend(fontsize=8, title="gold score, pairs joined", title_fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title("t-SNE of STS pairs" + (f"\n{title}" if title else ""))
    path = save_figure(fig, png_path)
    return {"figure": str(path), "pair_indices": pairs.tolist()}


def analyze_sts_pairs(
    encode: Encode,
    first: Sequence[str],
    second: Sequence[str],
    scores: Sequence[float],
    figure_dir: str | os.PathLike,
    *,
    name: str = "model",
    positive_threshold: float = 4.0,
    tsne_groups: Sequence[float] = TSNE_GROUPS,
    pairs_per_group: int = 10,
    seed: int = 0,
) -> dict:
    """Alignment/uniformity, cosine per gold bucket and t-SNE of one model on STS pairs (e.g. STS-B test).

    Encodes each distinct sentence once; writes ``{name}_cosine_distribution.png`` and
    ``{name}_tsne.png`` (titled ``name``) into ``figure_dir`` and returns the numbers plus the figure
    paths (``write_report`` input, which links them in place when they are in its figures folder).
    """
    gold = _check_pairs(first, second, scores)
    emb_first, emb_second, distinct = encode_pairs(encode, first, second)
    cosines = paired_cosine(emb_first, emb_second)
    figure_dir = Path(figure_dir)
    result = alignment_uniformity(emb_first, emb_second, gold, distinct, positive_threshold=positive_threshold)
    result["cosine_buckets"] = cosine_by_score_bucket(cosines, gold)
    cosine_png = plot_cosine_by_score_bucket(
        cosines, gold, figure_dir / f"{safe_filename(name)}_cosine_distribution.png", title=name
    )
    tsne = tsne_pairs(
        emb_first,
        emb_second,
        gold,
        figure_dir / f"{safe_filename(name)}_tsne.png",
        groups=tsne_groups,
        pairs_per_group=pairs_per_group,
        seed=seed,
        title=name,
    )
    result["figures"] = {"cosine_distribution": str(cosine_png), "tsne": tsne["figure"]}
    return result


def most_frequent_tokens(sentences: Sequence[str], k: int) -> list[str]:
    """The ``k`` most frequent lower-cased tokens; ties broken by first occurrence."""
    counts = Counter(token for s in sentences for token in TOKEN_PATTERN.findall(s.lower()))
    return [token for token, _ in counts.most_common(k)]


def remove_tokens(sentence: str, tokens: set[str]) -> str:
    """``sentence`` without the given tokens (case-insensitive), other text kept as written."""
    kept = [piece for piece in re.findall(r"\w+|[^\w\s]|\s+", sentence) if piece.lower() not in tokens]
    return " ".join("".join(kept).split())


def frequent_token_removal(
    encode_pass: Callable[[int], Encode],
    sts_score: Callable[[Encode], float],
    corpus: Sequence[str],
    ks: Sequence[int] = FREQUENT_KS,
) -> dict:
    """``sts_score`` of text without the k most frequent tokens of ``corpus``, per k, encoded by
    ``encode_pass(k)`` (one encoder per pass, so a caller can name the pass on its progress bar).

    ConPVP counts frequencies on the STS-B test split: pass its sentences as ``corpus``.
    """
    if not ks or min(ks) < 0:
        raise ValueError(f"ks must be a non-empty list of token counts >= 0, got {list(ks)}")
    ranked = most_frequent_tokens(corpus, max(ks))
    scores = []
    for k in ks:
        removed, encode = set(ranked[:k]), encode_pass(k)

        def encode_without(sentences: list[str], removed: set[str] = removed, encode: Encode = encode) -> np.ndarray:
            return encode([remove_tokens(s, removed) for s in sentences])

        scores.append(float(sts_score(encode_without if removed else encode)))
    return {"ks": list(ks), "scores": scores, "removed_tokens": ranked}
