"""SentEmbDataModule: a training corpus plus the STS evaluation sets."""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from ..errors import SentEmbUserError
from ..evaluation.suite import parse_evaluators
from .corpus import tokenized_corpus
from .paths import require_file, resolve_data_dir
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
        eval_batch_size: pairs per evaluation batch; `sentemb fit` also gives it to the method (`encode`).
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

    def check_data(self, stage: str) -> None:
        """Fail with the missing path and the fetch command before a run (and its W&B run) starts:
        the training corpus for `fit`, the STS sets the stage evaluates."""
        if stage == "fit":
            require_file(self.train_path(), "training corpus")
        for name in self.test_tasks if stage == "test" else self.val_tasks:
            load_sts_task(name, self.data_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:
            self.method = self.trainer.lightning_module
        if stage in ("fit", None) and self.train_dataset is None:
            specials = self.method.encoder.format.num_special_tokens
            self._check_training_options(specials)
            self.train_dataset = tokenized_corpus(
                self.train_path(), self.method.tokenizer, self.hparams.max_seq_len - specials,
                self.hparams.cache_dir, self.hparams.max_train_examples,
            )
            self._check_one_batch()

    def _check_training_options(self, specials: int) -> None:
        """Refuse what cannot train: one sentence a batch (the in-batch contrastive loss is then
        exactly 0) and a length that leaves no token for the sentence after the special tokens."""
        if self.hparams.batch_size < 2:
            raise SentEmbUserError(
                f"data.batch_size is {self.hparams.batch_size}: the in-batch contrastive loss needs other "
                "sentences as negatives (with one it is exactly 0); set --data.batch_size 2 or more (papers: 64)"
            )
        if self.hparams.max_seq_len <= specials:
            raise SentEmbUserError(
                f"data.max_seq_len is {self.hparams.max_seq_len}, which leaves no token for the sentence after "
                f"the {specials} special token(s); set --data.max_seq_len {specials + 1} or more (papers: 32)"
            )

    def _check_one_batch(self) -> None:
        """Training drops the last incomplete batch: a corpus smaller than one batch per device would
        train nothing and still end 'successfully'."""
        devices = self.trainer.world_size if self.trainer is not None else 1
        if len(self.train_dataset) < self.hparams.batch_size * devices:
            raise SentEmbUserError(
                f"{self.train_path()}: {len(self.train_dataset)} training example(s), fewer than one batch "
                f"(data.batch_size {self.hparams.batch_size} x {devices} device(s)); use a larger corpus "
                "(or a larger data.max_train_examples) or a smaller --data.batch_size"
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_dataset, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
            collate_fn=self.method.collate, num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
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
