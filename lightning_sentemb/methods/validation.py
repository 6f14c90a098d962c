"""STS validation and test inside a run (`validation_step` / `test_step` and their epoch ends) and the
DataModule's other evaluators, run on every rank with the work shared (`encode_across_ranks`).
`SentEmbMethod`'s Lightning hooks call these."""

from __future__ import annotations

import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import nn

from ..data.senteval import DEV_TASKS, STS_SUBSETS, STS_TASKS
from ..evaluation import SENTEVAL_KFOLD
from ..evaluation.across_ranks import evaluate_across_ranks
from ..evaluation.sts import StsSpearman, format_table
from ..evaluation.suite import headline_scores
from ..matryoshka import truncate


def sts_metrics(aggregation: str) -> nn.ModuleDict:
    """One streaming Spearman metric per STS task (test) and dev task (validation)."""
    return nn.ModuleDict({
        task.replace(".", "_"): StsSpearman(STS_SUBSETS.get(task, (task,)), aggregation)
        for task in STS_TASKS + DEV_TASKS
    })


def validating(method: LightningModule) -> bool:
    """Whether the method runs a validation loop now (a fit's, its sanity check, or `sentemb validate`):
    the methods whose reference selects checkpoints on another embedding than it tests ask."""
    trainer = method._trainer
    return trainer is not None and (trainer.validating or trainer.sanity_checking)


def sts_step(method: LightningModule, batch: dict[str, Any], dim: int | None = None) -> None:
    """Cosines of a batch of STS pairs into the task's metric; on the first `dim` dimensions when given."""
    n = len(batch["first"])
    embeddings = method.encode_batch(batch["first"] + batch["second"])
    if dim is not None:
        embeddings = truncate(embeddings, dim)
    cosines = torch.nn.functional.cosine_similarity(embeddings[:n].float(), embeddings[n:].float(), dim=-1)
    method.sts_metrics[batch["task"].replace(".", "_")].update(batch["index"], cosines, batch["gold"], batch["subset"])


def validation_step(method: LightningModule, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
    """STS dev, on the first `matryoshka_eval_dim` dimensions when set (what selects `best.ckpt`)."""
    sts_step(method, batch, method.hparams.matryoshka_eval_dim)


def test_step(method: LightningModule, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
    """STS test on every dimension."""
    sts_step(method, batch)


def log_sts(method: LightningModule, stage: str) -> dict[str, float]:
    """The stage's STS scores (and their average), logged and returned; the metrics are reset."""
    datamodule = method.trainer.datamodule
    scores = {}
    for task in datamodule.val_tasks if stage == "val" else datamodule.test_tasks:
        metric = method.sts_metrics[task.replace(".", "_")]
        scores[task] = float(metric.compute())
        metric.reset()
    if len(scores) > 1:
        scores["avg"] = float(np.mean(list(scores.values())))
    method.log_dict({f"{stage}/{k}": v for k, v in scores.items()}, sync_dist=False)
    return scores


def run_extra_evaluators(method: LightningModule, stage: str) -> None:
    """Evaluators beyond STS named by the DataModule (`val_evaluators` / `test_evaluators`), on every
    rank: each encodes its share of the sentences (`encode_across_ranks`; under FSDP every forward is a
    collective) and scores its share of the tasks (`evaluate_across_ranks`); every rank gets all results,
    which rank 0 logs (and plots). Validation's transfer tasks take `data.val_transfer_kfold` folds, the
    test SentEval's 10."""
    trainer = method.trainer
    datamodule = trainer.datamodule
    names = list(getattr(datamodule, f"{stage}_evaluators", ()))
    if not names:
        return
    kfold = getattr(datamodule, "val_transfer_kfold", SENTEVAL_KFOLD) if stage == "val" else SENTEVAL_KFOLD
    figures = Path(trainer.default_root_dir) / "figures" / f"{stage}-step{method.global_step}"
    with nullcontext(figures) if trainer.is_global_zero else tempfile.TemporaryDirectory() as figure_dir:
        results = evaluate_across_ranks(method.encode_across_ranks, names, datamodule.data_dir, figure_dir,
                                        name=type(method).__name__, transfer_kfold=kfold)
    metrics = {f"{stage}/{k}": v for k, v in headline_scores(results).items()}
    if trainer.is_global_zero:
        for logger in method.loggers:
            logger.log_metrics(metrics, step=method.global_step)


def on_validation_epoch_end(method: LightningModule) -> None:
    """Log STS dev and the other evaluators; the sanity check's scores are dropped."""
    if method.trainer.sanity_checking:
        for metric in method.sts_metrics.values():
            metric.reset()
        return
    log_sts(method, "val")
    run_extra_evaluators(method, "val")


def on_test_epoch_end(method: LightningModule) -> None:
    """Log the STS test scores (kept as `test_results`) and the other evaluators; rank 0 prints the table."""
    method.test_results = log_sts(method, "test")
    run_extra_evaluators(method, "test")
    if method.trainer.is_global_zero:
        print("\n" + format_table({type(method).__name__: method.test_results}), flush=True)
