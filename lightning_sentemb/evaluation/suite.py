"""One entry point for every evaluator, shared by `sentemb evaluate` and the test-time hook."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.clustering import CLUSTERING_TASKS, ClusteringData, load_clustering_task
from ..data.senteval import STS_TASKS, StsTask, load_sts_task
from ..data.transfer import TRANSFER_TASKS, TransferSplits, load_transfer_task
from . import SENTEVAL_KFOLD, parse_evaluators
from .metrics import TaskLabelledEncode
from .sts import evaluate_sts

# A capped transfer split keeps at least this many examples of each class (when it has them): enough
# for the 10 cross-validation folds and the 16-shot draws.
MIN_PER_CLASS = 20


def capped(data: Any, limit: int | None, min_per_class: int = 0, seed: int = 0) -> Any:
    """`data` (an StsTask, a transfer split, a clustering task) with about `limit` rows, drawn at random
    (seeded) and kept in their order; labelled data is drawn per class, in proportion, with at least
    `min_per_class` of each where it has them. None or a larger `limit`: `data` itself."""
    columns = {f.name: getattr(data, f.name) for f in fields(data)
               if isinstance(getattr(data, f.name), (list, np.ndarray))}
    size = len(next(iter(columns.values())))
    if limit is None or size <= limit:
        return data
    rng = np.random.default_rng(seed)
    labels = getattr(data, "labels", None)
    if labels is None:
        keep = rng.choice(size, limit, replace=False)
    else:
        keep = np.concatenate([
            rng.choice(members, min(len(members), max(min_per_class, round(limit * len(members) / size))),
                       replace=False)
            for members in (np.flatnonzero(labels == label) for label in np.unique(labels))
        ])
    keep = np.sort(keep)
    return replace(data, **{name: value[keep] if isinstance(value, np.ndarray) else [value[i] for i in keep]
                            for name, value in columns.items() if len(value) == size})


@dataclass
class SuitePlan:
    """The data of every evaluator asked for, loaded (and capped) before any encoding: what `sentemb
    evaluate` prints as its plan, then runs."""

    evaluators: list[str]
    max_examples: int | None = None
    sts: list[StsTask] = field(default_factory=list)
    transfer: dict[str, TransferSplits] = field(default_factory=dict)
    clustering: dict[str, ClusteringData] = field(default_factory=dict)
    analysis_pairs: StsTask | None = None
    # the folds of MR, CR, SUBJ, MPQA (and of picking C); validation takes `data.val_transfer_kfold`
    transfer_kfold: int = SENTEVAL_KFOLD
    # each STS task encoded by its own call (`evaluate --whiten task`: each task whitened by its own fit)
    sts_per_task: bool = False

    @classmethod
    def load(cls, evaluators: Sequence[str], data_dir: str | os.PathLike | None = None,
             max_examples: int | None = None) -> SuitePlan:
        evaluators = parse_evaluators(evaluators)
        plan = cls(evaluators, max_examples)
        if {"sts", "analysis"} & set(evaluators):
            plan.sts = [capped(load_sts_task(t, data_dir), max_examples) for t in STS_TASKS]
        if "analysis" in evaluators:  # whole: its t-SNE needs 10 pairs at each of the gold scores 0, 3 and 5
            plan.analysis_pairs = load_sts_task("STSBenchmark", data_dir)
        if {"transfer", "fewshot"} & set(evaluators):
            plan.transfer = {name: {key: capped(split, max_examples, MIN_PER_CLASS) for key, split in
                                    load_transfer_task(name, data_dir).items()} for name in TRANSFER_TASKS}
        if "cluster" in evaluators:
            plan.clustering = {name: capped(load_clustering_task(name, data_dir), max_examples)
                               for name in CLUSTERING_TASKS}
        return plan

    def sentences(self) -> dict[str, list[str]]:
        """The sentences each evaluator encodes (per model), by evaluator."""
        planned: dict[str, list[str]] = {}
        if "sts" in self.evaluators:
            planned["sts"] = list(dict.fromkeys(s for task in self.sts for s in task.first + task.second))
        if self.transfer:
            planned["transfer"] = [s for splits in self.transfer.values() for split in splits.values()
                                   for s in getattr(split, "sentences", None) or split.first + split.second]
        if self.clustering:
            planned["cluster"] = [s for data in self.clustering.values() for s in data.sentences]
        if "analysis" in self.evaluators:  # the pairs, then the STS sets once per frequent-token pass
            from .analysis import FREQUENT_KS

            every_sts = list(dict.fromkeys(s for task in self.sts for s in task.first + task.second))
            pairs = self.analysis_pairs
            planned["analysis"] = [*dict.fromkeys(pairs.first + pairs.second), *every_sts * len(FREQUENT_KS)]
        return planned

    def describe(self) -> str:
        """One line per evaluator: its tasks and the sentences it encodes."""
        from .analysis import FREQUENT_KS

        tasks = {"sts": len(self.sts), "transfer": len(self.transfer), "cluster": len(self.clustering),
                 "analysis": 1 + len(FREQUENT_KS)}
        cap = f", each task capped at {self.max_examples:,} examples (--max-examples)" if self.max_examples else ""
        lines = [f"plan: {', '.join(self.evaluators)}{cap}"]
        lines += [f"  {name:9} {tasks[name]} task(s), {len(sentences):,} sentences"
                  for name, sentences in self.sentences().items()]
        return "\n".join(lines)


def evaluate_suite(
    encode: Callable[..., torch.Tensor],
    evaluators: Sequence[str] | SuitePlan,
    data_dir: str | os.PathLike | None = None,
    figure_dir: str | os.PathLike = "figures",
    name: str = "model",
    aggregation: str = "all",
    on_result: Callable[[dict[str, dict]], None] | None = None,
) -> dict[str, dict]:
    """Run the named evaluators (or a loaded `SuitePlan`) with one `encode`; keys: sts, transfer,
    clustering, analysis, frequent_tokens.

    `encode(sentences, label=...)` is `SentEmbMethod.encode`: the label names the model (`name`), the
    evaluator and the task or pass on its progress bar. `on_result(results so far)` is called as each
    task finishes (each transfer and clustering task, each evaluator), so a caller can keep finished
    results when a later one fails or is interrupted. `fewshot` adds ConPVP's 16-shot runs to the
    transfer results (and implies `transfer`).
    """
    from .analysis import analyze_sts_pairs, frequent_token_removal
    from .clustering import evaluate_clustering_data
    from .transfer import evaluate_transfer_splits

    plan = evaluators if isinstance(evaluators, SuitePlan) else SuitePlan.load(evaluators, data_dir)

    def labelled(label: str) -> Callable[..., torch.Tensor]:  # other keywords go on (`evaluate_sts`'s task)
        return lambda sentences, **kwargs: encode(list(sentences), label=f"{name} · {label}", **kwargs)

    def numpy(evaluator: str) -> TaskLabelledEncode:
        return TaskLabelledEncode(lambda sentences, label: encode(list(sentences), label=label).float().cpu().numpy(),
                                  f"{name} · {evaluator}")

    def finished(key: str, result: dict) -> None:
        results[key] = result
        if on_result is not None:
            on_result(results)

    results: dict[str, dict] = {}
    if plan.max_examples:
        results["max_examples"] = plan.max_examples
    if "sts" in plan.evaluators:
        finished("sts", evaluate_sts(labelled("sts"), plan.sts, aggregation, plan.sts_per_task))
    for task, splits in plan.transfer.items():
        done = evaluate_transfer_splits(numpy("transfer"), task, splits, kfold=plan.transfer_kfold,
                                        few_shot="fewshot" in plan.evaluators)
        finished("transfer", {**results.get("transfer", {}), task: done})
    for task, data in plan.clustering.items():
        done = evaluate_clustering_data(numpy("cluster"), task, data)
        finished("clustering", {**results.get("clustering", {}), task: done})
    if "analysis" in plan.evaluators:
        stsb = plan.analysis_pairs
        finished("analysis", analyze_sts_pairs(numpy("analysis"), stsb.first, stsb.second, stsb.gold,
                                               Path(figure_dir), name=name))
        finished("frequent_tokens", frequent_token_removal(
            lambda k: numpy(f"analysis: STS without the {k} most frequent tokens"),
            lambda enc: evaluate_sts(lambda s: torch.as_tensor(enc(s)), plan.sts, aggregation)["avg"],
            stsb.first + stsb.second,
        ))
    return results


def headline_scores(results: dict[str, dict]) -> dict[str, float]:
    """The numbers worth logging as metrics: transfer accuracy, few-shot mean, clustering ACC/NMI,
    alignment/uniformity and STS (flat `family/task` keys)."""
    scores: dict[str, float] = {f"sts/{k}": v for k, v in results.get("sts", {}).items()}
    for task, r in results.get("transfer", {}).items():
        scores[f"transfer/{task}"] = r["acc"]
        if "few_shot" in r:
            scores[f"fewshot/{task}"] = r["few_shot"]["mean"]
    for task, r in results.get("clustering", {}).items():
        scores[f"cluster/{task}/acc"] = r["acc"]
        scores[f"cluster/{task}/nmi"] = r["nmi"]
    for key in ("alignment", "uniformity"):
        if key in results.get("analysis", {}):
            scores[f"analysis/{key}"] = results["analysis"][key]
    return scores
