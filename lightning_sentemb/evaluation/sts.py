"""STS scoring as SentEval (SimCSE's fork) computes it. Pure functions; no Lightning inside."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy.stats import spearmanr
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from ..data.senteval import SHORT_NAMES, StsTask


def spearman(pred: np.ndarray, gold: np.ndarray) -> float:
    return float(spearmanr(pred, gold).correlation)


def sts_correlations(pred: np.ndarray, gold: np.ndarray, subsets: Sequence[str]) -> dict[str, float]:
    """Spearman ×100 for one task: 'all' (concatenate every subset, one Spearman: the number
    SimCSE and the seed papers report), 'wmean' (subset Spearmans weighted by size), 'mean',
    and one entry per subset."""
    subsets = np.asarray(subsets)
    result = {"all": 100 * spearman(pred, gold)}
    per_subset = {}
    for name in dict.fromkeys(subsets.tolist()):
        member = subsets == name
        per_subset[name] = (100 * spearman(pred[member], gold[member]), int(member.sum()))
    sizes = np.array([n for _, n in per_subset.values()], dtype=np.float64)
    scores = np.array([s for s, _ in per_subset.values()])
    result["wmean"] = float((scores * sizes).sum() / sizes.sum())
    result["mean"] = float(scores.mean())
    result.update({f"subset/{name}": score for name, (score, _) in per_subset.items()})
    return result


def pair_cosines(embed_first: torch.Tensor, embed_second: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.cosine_similarity(embed_first.float(), embed_second.float(), dim=-1).cpu().numpy()


def evaluate_sts(
    encode: Callable[[list[str]], torch.Tensor],
    tasks: Sequence[StsTask],
    aggregation: str = "all",
    per_task: bool = False,
) -> dict[str, float]:
    """{task: Spearman ×100, ..., 'avg': mean over tasks}. Each distinct sentence is encoded once, all in
    one call of `encode`, or with `per_task` one call per task, `encode(sentences, task=NAME)` (a whitening
    fitted on each task's own, `evaluation.whitening.per_task_whitened`)."""
    scores: dict[str, float] = {}
    for group in ([task] for task in tasks) if per_task else [tasks]:
        sentences = list(dict.fromkeys(s for task in group for s in task.first + task.second))
        embeddings = encode(sentences, task=group[0].name) if per_task else encode(sentences)
        row = {s: i for i, s in enumerate(sentences)}
        for task in group:
            first = embeddings[[row[s] for s in task.first]]
            second = embeddings[[row[s] for s in task.second]]
            scores[task.name] = sts_correlations(pair_cosines(first, second), task.gold, task.subsets)[aggregation]
    scores["avg"] = float(np.mean(list(scores.values())))
    return scores


def format_table(rows: dict[str, dict[str, float]]) -> str:
    """Markdown table, one row per model/run, columns in the papers' order."""
    columns = list(next(iter(rows.values())).keys())
    header = "| model | " + " | ".join(SHORT_NAMES.get(c, c) for c in columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 1)]
    for name, scores in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{scores[c]:.2f}" for c in columns) + " |")
    return "\n".join(lines)


class StsSpearman(Metric):
    """Streaming STS correlation whose state is right under DDP by construction.

    States are concatenated across ranks (`cat`), and rows are de-duplicated by pair index,
    because a distributed sampler pads its last shard with repeated pairs.
    """

    full_state_update = False

    def __init__(self, subset_names: Sequence[str], aggregation: str = "all") -> None:
        super().__init__()
        self.subset_names = list(subset_names)
        self.aggregation = aggregation
        for state in ("index", "pred", "gold", "subset"):
            self.add_state(state, default=[], dist_reduce_fx="cat")

    def update(self, index: torch.Tensor, pred: torch.Tensor, gold: torch.Tensor, subset: torch.Tensor) -> None:
        self.index.append(index.long())
        self.pred.append(pred.float())
        self.gold.append(gold.float())
        self.subset.append(subset.long())

    def compute(self) -> torch.Tensor:
        index, pred, gold, subset = (dim_zero_cat(s).cpu().numpy()
                                     for s in (self.index, self.pred, self.gold, self.subset))
        _, first = np.unique(index, return_index=True)
        names = np.asarray(self.subset_names)[subset[first]]
        correlations = sts_correlations(pred[first].astype(np.float64), gold[first].astype(np.float64), names)
        score = correlations[self.aggregation]
        return torch.tensor(score)
