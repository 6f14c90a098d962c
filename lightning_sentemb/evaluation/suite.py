"""One entry point for every evaluator, shared by `sentemb evaluate` and the test-time hook."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..data.senteval import STS_TASKS, load_sts_task
from . import parse_evaluators
from .metrics import TaskLabelledEncode
from .sts import evaluate_sts


def evaluate_suite(
    encode: Callable[..., torch.Tensor],
    evaluators: Sequence[str],
    data_dir: str | os.PathLike | None = None,
    figure_dir: str | os.PathLike = "figures",
    name: str = "model",
    aggregation: str = "all",
    on_result: Callable[[dict[str, dict]], None] | None = None,
) -> dict[str, dict]:
    """Run the named evaluators with one `encode`; keys: sts, transfer, clustering, analysis, frequent_tokens.

    `encode(sentences, label=...)` is `SentEmbMethod.encode`: the label names the model (`name`), the
    evaluator and the task or pass on its progress bar. `on_result(results so far)` is called as each evaluator finishes, so a caller can
    keep finished results when a later one fails. `fewshot` adds ConPVP's 16-shot runs to the
    transfer results (and implies `transfer`).
    """
    from .analysis import analyze_sts_pairs, frequent_token_removal
    from .clustering import evaluate_clustering
    from .transfer import evaluate_transfer

    def labelled(label: str) -> Callable[[list[str]], torch.Tensor]:
        return lambda sentences: encode(list(sentences), label=f"{name} · {label}")

    def numpy(evaluator: str) -> TaskLabelledEncode:
        return TaskLabelledEncode(lambda sentences, label: encode(list(sentences), label=label).float().cpu().numpy(),
                                  f"{name} · {evaluator}")

    def finished(key: str, result: dict) -> None:
        results[key] = result
        if on_result is not None:
            on_result(results)

    evaluators = parse_evaluators(evaluators)
    results: dict[str, dict] = {}
    if "sts" in evaluators:
        finished("sts", evaluate_sts(labelled("sts"), [load_sts_task(t, data_dir) for t in STS_TASKS], aggregation))
    if "transfer" in evaluators or "fewshot" in evaluators:
        finished("transfer", evaluate_transfer(numpy("transfer"), data_dir, few_shot="fewshot" in evaluators))
    if "cluster" in evaluators:
        finished("clustering", evaluate_clustering(numpy("cluster"), data_dir))
    if "analysis" in evaluators:
        stsb = load_sts_task("STSBenchmark", data_dir)
        finished("analysis", analyze_sts_pairs(numpy("analysis"), stsb.first, stsb.second, stsb.gold,
                                               Path(figure_dir), name=name))
        sts_tasks = [load_sts_task(t, data_dir) for t in STS_TASKS]
        finished("frequent_tokens", frequent_token_removal(
            lambda k: numpy(f"analysis: STS without the {k} most frequent tokens"),
            lambda enc: evaluate_sts(lambda s: torch.as_tensor(enc(s)), sts_tasks, aggregation)["avg"],
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
