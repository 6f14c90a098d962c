"""SentEmbDataModule: a training corpus plus the STS evaluation sets."""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from ..evaluation.suite import parse_evaluators
from .corpus import tokenized_corpus
from .paths import resolve_data_dir
from .senteval import DEV_TASKS, STS_SUBSETS, STS_TASKS, StsTask, load_sts_task


class StsPairs(Dataset):
    """Pairs of one STS task, ordered by length so evaluation batches pad little.

    Each item keeps its original index, so metrics can de-duplicate the DDP sampler's padding.
    """

    def __init__(self, task: StsTask) -> None:
        self.task = task
        self.subset_ids = {name: i for i, name in enumerate(STS_SUBSETS.get(task.name, (task.name,)))}
        lengths = [len(a) + len(b) for a, b in zip(task.first, task.second)]
        self.order = np.argsort(lengths, kind="stable")

    def __len__(self) -> int:
        return len(self.task)

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = int(self.order[i])
        task = self.task
        return {"index": j, "first": task.first[j], "second": task.second[j], "gold": float(task.gold[j]),
                "subset": self.subset_ids[task.subsets[j]], "task": task.name}


def collate_pairs(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "index": torch.tensor([it["index"] for it in items]),
        "first": [it["first"] for it in items],
        "second": [it["second"] for it in items],
        "gold": torch.tensor([it["gold"] for it in items]),
        "subset": torch.tensor([it["subset"] for it in items]),
        "task": items[0]["task"],
    }


class SentEmbDataModule(LightningDataModule):
    """Training corpus + STS evaluation sets.

    Args:
        train_file: one sentence a line (`.txt`) or SimCSE's NLI csv (`sent0,sent1,hard_neg`);
            a relative path is looked up under `data_dir`.
        data_dir: data directory (SimCSE/SentEval layout); default `$SENTEMB_DATA`, else `./data`.
        max_seq_len: training length in tokens, special tokens included (templates come on top).
        batch_size: per-device training batch; the global batch is batch_size × devices.
        eval_batch_size: pairs per evaluation batch.
        num_workers: DataLoader workers.
        max_train_examples: use only the first N training examples (demos, tests).
        val_tasks / test_tasks: STS tasks by SentEval name, evaluated at validation / test.
        cache_dir: where tokenized corpora are cached (default `$SENTEMB_CACHE` or ~/.cache).
        val_evaluators / test_evaluators: evaluators beyond STS run at each validation / at test
            (`transfer`, `fewshot`, `cluster`, `analysis`); logged as `val/transfer/MR`, ... .
    """

    def __init__(
        self,
        train_file: str = "corpora/wiki1m_for_simcse.txt",
        data_dir: str | None = None,
        max_seq_len: int = 32,
        batch_size: int = 64,
        eval_batch_size: int = 128,
        num_workers: int = 0,
        max_train_examples: int | None = None,
        val_tasks: Sequence[str] = DEV_TASKS,
        test_tasks: Sequence[str] = STS_TASKS,
        cache_dir: str | None = None,
        val_evaluators: Sequence[str] = (),
        test_evaluators: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.val_tasks = list(val_tasks)
        self.test_tasks = list(test_tasks)
        self.val_evaluators = parse_evaluators(val_evaluators)
        self.test_evaluators = parse_evaluators(test_evaluators)
        self.method = None
        self.train_dataset = None

    @property
    def data_dir(self):
        return resolve_data_dir(self.hparams.data_dir)

    def train_path(self) -> str:
        path = self.hparams.train_file
        return path if os.path.isabs(path) else str(self.data_dir / path)

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:
            self.method = self.trainer.lightning_module
        if stage in ("fit", None) and self.train_dataset is None:
            fmt = self.method.encoder.format
            self.train_dataset = tokenized_corpus(
                self.train_path(), self.method.tokenizer, self.hparams.max_seq_len - fmt.num_special_tokens,
                self.hparams.cache_dir, self.hparams.max_train_examples,
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_dataset, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
            collate_fn=self.method.collate, num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0, pin_memory=torch.cuda.is_available(),
        )

    def _sts_loaders(self, tasks: list[str]) -> list[DataLoader]:
        return [
            DataLoader(StsPairs(load_sts_task(name, self.data_dir)), batch_size=self.hparams.eval_batch_size,
                       collate_fn=collate_pairs)
            for name in tasks
        ]

    def val_dataloader(self) -> list[DataLoader]:
        return self._sts_loaders(self.val_tasks)

    def test_dataloader(self) -> list[DataLoader]:
        return self._sts_loaders(self.test_tasks)
