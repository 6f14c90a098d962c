"""The evaluators of validation and test on every rank of a process group, the scoring shared: the ranks
encode together, then each scores its own transfer and clustering tasks (sklearn, faiss K-means) and the
results are gathered, so every rank ends with the results one process computes."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..distributed import gather_or_raise, world
from . import SENTEVAL_KFOLD
from .suite import SuitePlan, evaluate_suite

SPLIT = ("transfer", "fewshot", "cluster")  # evaluators whose tasks are scored by one rank each


def assign_tasks(sizes: dict[str, int], ranks: int) -> list[list[str]]:
    """Tasks by rank: the largest first, each to the rank with the least work so far (by sentences), so no
    rank waits on another's long scoring more than the split needs. The same on every rank."""
    load, tasks = [0] * ranks, [[] for _ in range(ranks)]
    for task in sorted(sizes, key=lambda t: (-sizes[t], t)):
        rank = load.index(min(load))
        load[rank] += sizes[task]
        tasks[rank].append(task)
    return tasks


def evaluate_across_ranks(
    encode: Callable[..., torch.Tensor],
    evaluators: Sequence[str],
    data_dir: str | os.PathLike | None,
    figure_dir: str | os.PathLike,
    name: str,
    transfer_kfold: int = SENTEVAL_KFOLD,
) -> dict[str, dict]:
    """`evaluate_suite` where `encode` is `SentEmbMethod.encode_across_ranks` (every rank calls it with the
    same sentences). The sentences of the transfer and clustering tasks are encoded once, together; each
    rank scores its tasks (`assign_tasks`) on them and every rank gets all results (`gather_or_raise`: one
    collective after the scoring; a rank's error is raised on every rank). STS and the analysis run as in one
    process, on every rank.
    `transfer_kfold`: `SuitePlan.transfer_kfold`."""
    plan = replace(SuitePlan.load(evaluators, data_dir), transfer_kfold=transfer_kfold)
    rank, size = world()
    if size == 1:
        return evaluate_suite(encode, plan, figure_dir=figure_dir, name=name)
    split = replace(plan, evaluators=[e for e in plan.evaluators if e in SPLIT], sts=[], analysis_pairs=None)
    rest = replace(plan, evaluators=[e for e in plan.evaluators if e not in SPLIT], transfer={}, clustering={})
    results = evaluate_suite(encode, rest, figure_dir=figure_dir, name=name) if rest.evaluators else {}
    if not split.evaluators:
        return results
    sentences = list(dict.fromkeys(s for planned in split.sentences().values() for s in planned))
    rows = dict(zip(sentences, encode(sentences, label=f"{name} · {', '.join(split.evaluators)}"), strict=True))

    def encoded(batch: list[str], label: str = "") -> torch.Tensor:
        return torch.stack([rows[s] for s in batch])

    sizes = {f"transfer/{t}": sum(len(s) for s in SuitePlan(["transfer"], transfer={t: splits}).sentences().values())
             for t, splits in split.transfer.items()}
    sizes |= {f"cluster/{t}": len(data.sentences) for t, data in split.clustering.items()}
    mine = set(assign_tasks(sizes, size)[rank])
    own = replace(split, transfer={t: s for t, s in split.transfer.items() if f"transfer/{t}" in mine},
                  clustering={t: d for t, d in split.clustering.items() if f"cluster/{t}" in mine})
    everyone = gather_or_raise(lambda: evaluate_suite(encoded, own, figure_dir=figure_dir, name=name),
                               f"scoring {', '.join(sorted(mine)) or 'nothing'} of the {name} evaluation")
    for key, tasks in (("transfer", split.transfer), ("clustering", split.clustering)):
        found = {task: result for part in everyone for task, result in part.get(key, {}).items()}
        if tasks:
            results[key] = {task: found[task] for task in tasks}  # the plan's order, as one process
    return results
