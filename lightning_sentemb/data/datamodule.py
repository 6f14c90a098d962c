"""SentEmbDataModule: a training corpus plus the STS evaluation sets."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset

from ..errors import SentEmbUserError
from ..evaluation import parse_evaluators
from .corpus import corpus_cache_path, open_tokenized_corpus, tokenize_corpus
from .paths import MissingDataError, require_file, resolve_data_dir
from .senteval import DEV_TASKS, STS_SUBSETS, STS_TASKS, StsTask, load_sts_task
from .sts_corpus import STS_CORPUS, sts_corpus_file


class Collator(Protocol):
    """A method's collator as the loaders use it (`methods.collator.Collator`; the data layer sits below
    the methods and does not import them)."""

    generator: torch.Generator

    def __call__(self, examples: list[Any]) -> dict[str, Any]: ...

    def check_columns(self, columns: list[str], source: str) -> None: ...


class StsPairs(Dataset):
    """Pairs of one STS task, ordered by length so evaluation batches pad little.

    Each item keeps its original index, so metrics can de-duplicate the DDP sampler's padding.
    """

    def __init__(self, task: StsTask) -> None:
        self.task = task
        self.subset_ids = {name: i for i, name in enumerate(STS_SUBSETS.get(task.name, (task.name,)))}
        lengths = [len(a) + len(b) for a, b in zip(task.first, task.second, strict=True)]
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


def batch_seed(*key: int) -> int:
    """A 63-bit seed drawn from integers (run seed, epoch, rank, batch): unrelated for nearby keys."""
    return int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0] >> np.uint64(1))


class ResumableBatchSampler:
    """Shuffled training batches that can start mid-epoch, DDP-sharded.

    Epoch e's order is a permutation seeded by (seed, e), the same on every rank; like
    `DistributedSampler`, rank r takes every world_size-th example from r, and each rank drops its
    incomplete last batch. `resume(batches_done)` (batches trained since the run began) starts at
    the epoch and batch where those end, so a resumed run sees exactly the remaining ones.

    Each batch is a list of (batch seed, example index): the seed, from (seed, epoch, rank, batch
    number), seeds what `collate` draws (the generator of the method's `collator`), so MLM masks and
    templates differ across batches, ranks and DataLoader workers and repeat after a resume
    whatever `num_workers` is.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.resume_point = (0, 0)

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning before each epoch."""
        self.epoch = epoch

    def resume(self, batches_done: int) -> None:
        self.resume_point = divmod(batches_done, len(self)) if len(self) else (0, 0)
        self.epoch = self.resume_point[0]

    def __len__(self) -> int:
        return self.num_examples // self.num_replicas // self.batch_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        generator = torch.Generator().manual_seed(batch_seed(self.seed, epoch))
        usable = self.num_examples // self.num_replicas * self.num_replicas
        # a tensor (8 bytes an example), each batch's indices made Python ints only when it is drawn
        order = torch.randperm(self.num_examples, generator=generator)[:usable][self.rank :: self.num_replicas]
        first = self.resume_point[1] if self.resume_point[0] == epoch else 0
        for b in range(first, len(self)):
            seed = batch_seed(self.seed, epoch, self.rank, b)
            yield [(seed, i) for i in order[b * self.batch_size : (b + 1) * self.batch_size].tolist()]


class SeededExamples(Dataset):
    """`dataset[i]` for the sampler's (batch seed, i) keys, the seed passed along to `collate`."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, Any]:
        seed, index = key
        return seed, self.dataset[index]


class SeededCollate:
    """Seeds the method's collator's `generator` with the batch's seed, then calls the collator
    (`methods.collator.Collator`: what a worker start pickles, never the module)."""

    def __init__(self, collator: Collator) -> None:
        self.collator = collator

    def __call__(self, items: list[tuple[int, Any]]) -> dict[str, Any]:
        self.collator.generator.manual_seed(items[0][0])
        return self.collator([example for _, example in items])


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM and Ctrl-C to the training process, which stops at a step
    boundary and then shuts them down (a worker killed first would fail the step in flight)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class TrainLoader:
    """The training DataLoader over a `ResumableBatchSampler`.

    Deliberately not a `DataLoader` itself: under DDP Lightning would swap the sampling for a
    `DistributedSampler`, which cannot start mid-epoch. Exposes what Lightning and the methods read:
    `dataset`, `batch_size`, and `sampler` (Lightning calls its `set_epoch` before each epoch).

    Resumable the way Lightning looks for it (`state_dict` / `load_state_dict`): checkpoints keep
    where the data stands, and a resumed fit restores it before the first batch (so Lightning does
    not warn that the loader is not resumable). The position is the number of batches trained since
    the run began, as the training loop counts them (`batches_trained`, set by the data module): the
    loop fetches ahead of training, so the loader cannot count them itself.

    `pin_memory` lets the batch reach the GPU by an asynchronous copy; `persistent_workers` keeps
    the worker processes from one epoch to the next (it applies with `num_workers` > 0 only).
    """

    batches_trained: Callable[[], int] | None = None

    def __init__(self, dataset: Dataset, batch_sampler: ResumableBatchSampler, collator: Collator, num_workers: int,
                 pin_memory: bool = False, persistent_workers: bool = False) -> None:
        self.dataset = dataset
        self.sampler = batch_sampler
        self.batch_size = batch_sampler.batch_size
        # its own generator: the workers' base seed never draws from (and shifts) torch's global RNG
        self.loader = DataLoader(SeededExamples(dataset), batch_sampler=batch_sampler, num_workers=num_workers,
                                 collate_fn=SeededCollate(collator), worker_init_fn=ignore_stop_signals,
                                 generator=torch.Generator().manual_seed(batch_sampler.seed), pin_memory=pin_memory,
                                 persistent_workers=persistent_workers and num_workers > 0)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.loader)

    def close(self) -> None:
        """Stop the worker processes now: the DataLoader is dropped, and with it its persistent iterator,
        whose workers are shut down as it is freed (the loader cannot be iterated again)."""
        self.loader = None

    def __len__(self) -> int:
        return len(self.sampler)

    def state_dict(self) -> dict[str, int]:
        return {"batches_done": self.batches_trained()} if self.batches_trained is not None else {}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.sampler.resume(state_dict.get("batches_done", 0))


class SentEmbDataModule(LightningDataModule):
    """Training corpus + STS evaluation sets.

    Args:
        train_file: one sentence a line (`.txt`) or SimCSE's NLI csv (`sent0,sent1,hard_neg`, or
            `hard_neg_1..hard_neg_k` as `sentemb data mine` writes); a relative path is looked up under `data_dir`.
            `senteval:sts`: the unlabeled sentences of the STS sets under `data_dir` (ConSERT's corpus,
            `data.sts_corpus`).
        data_dir: data directory (SimCSE/SentEval layout); default: `$SENTEMB_DATA`, else `./data` if it
            exists, else `../shared/data` (`data.paths.resolve_data_dir`, the rule of every command).
        max_seq_len: training length in tokens, special tokens included (templates come on top).
        batch_size: per-device training batch; the global batch is batch_size × devices.
        eval_batch_size: pairs per evaluation batch; `sentemb fit` also gives it to the method (`encode`).
        num_workers: DataLoader workers (the GPU presets in experiments/trainer/ use 4).
        pin_memory: page-locked training batches, copied to the GPU asynchronously; None = on when
            CUDA is available.
        persistent_workers: keep the DataLoader workers alive across epochs (with num_workers > 0).
        max_train_examples: use only the first N training examples (demos, tests).
        negate: add each sentence's negation to a one-sentence corpus as it is tokenized (SNCSE's soft
            negatives, column `negation`; a corpus that has the column keeps its own): a spaCy pipeline
            (`en_core_web_sm`, the reference's; the `negate` extra) or `lexicon` (no parser, cruder: demos);
            null = none (`sentemb data negate` writes the same column into a csv beforehand). docs/data.md.
        tokenize_workers: processes tokenizing the corpus into its cache (once per node, see
            `prepare_data`); None = the CPUs available, at most 8.
        prepare_data_per_node: tokenize on local rank 0 of every node (true: a `cache_dir` per
            node, the default `~/.cache`), or only on the first node (false: a `cache_dir` on a
            filesystem every node shares).
        val_tasks / test_tasks: STS tasks by SentEval name, evaluated at validation / test.
        cache_dir: where tokenized corpora are cached (default `$SENTEMB_CACHE` or ~/.cache).
        val_evaluators / test_evaluators: evaluators beyond STS run at each validation / at test
            (`transfer`, `fewshot`, `cluster`, `analysis`); logged as `val/transfer/MR`, ... .
        val_transfer_kfold: the folds of validation's transfer cross-validations (MR, CR, SUBJ, MPQA, and
            picking C on TREC and MRPC): 5, as SimCSE's evaluation during training (SentEval's fast mode;
            4x fewer classifier fits than 10); the test always takes SentEval's 10, as the papers report.
    """

    def __init__(
        self,
        train_file: str = "corpora/wiki1m_for_simcse.txt",
        data_dir: str | None = None,
        max_seq_len: int = 32,
        batch_size: int = 64,
        eval_batch_size: int = 128,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = False,
        max_train_examples: int | None = None,
        negate: str | None = None,
        tokenize_workers: int | None = None,
        prepare_data_per_node: bool = True,
        val_tasks: Sequence[str] = DEV_TASKS,
        test_tasks: Sequence[str] = STS_TASKS,
        cache_dir: str | None = None,
        val_evaluators: Sequence[str] = (),
        test_evaluators: Sequence[str] = (),
        val_transfer_kfold: int = 5,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.prepare_data_per_node = prepare_data_per_node
        self.val_tasks = list(val_tasks)
        self.test_tasks = list(test_tasks)
        self.val_evaluators = parse_evaluators(val_evaluators, "data.val_evaluators")
        self.test_evaluators = parse_evaluators(test_evaluators, "data.test_evaluators")
        if val_transfer_kfold < 2:
            raise SentEmbUserError(f"data.val_transfer_kfold is {val_transfer_kfold}: a cross-validation needs "
                                   "at least 2 folds (5 is SimCSE's, 10 SentEval's full mode)")
        self.val_transfer_kfold = val_transfer_kfold
        self.method = None
        self.train_dataset = None
        self.batches_done = 0
        self.train_loader: TrainLoader | None = None

    @property
    def data_dir(self):
        return resolve_data_dir(self.hparams.data_dir)

    def train_path(self) -> str:
        path = self.hparams.train_file
        if path == STS_CORPUS:
            try:
                return str(sts_corpus_file(self.data_dir, self.hparams.cache_dir))
            except MissingDataError as missing:
                raise missing.for_option("--data.data_dir") from None
        return path if os.path.isabs(path) else str(self.data_dir / path)

    def check_data(self, stage: str) -> None:
        """Fail with the missing path and the fetch command before a run (and its W&B run) starts:
        the training corpus for `fit`, the STS sets the stage evaluates."""
        try:
            if stage == "fit":
                require_file(self.train_path(), "training corpus")
            for name in self.test_tasks if stage == "test" else self.val_tasks:
                load_sts_task(name, self.data_dir)
        except MissingDataError as missing:
            raise missing.for_option("--data.data_dir") from None

    def prepare_data(self) -> None:
        """Tokenize the training corpus into its cache file, before `setup`. Lightning calls this in
        one process per node (local rank 0; with `prepare_data_per_node` false, in one process of
        the job) and holds the other ranks at a barrier until it is done."""
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self.method = trainer.lightning_module
            tokenize_corpus(*self._corpus_cache_args(), workers=self.hparams.tokenize_workers)

    def setup(self, stage: str | None = None) -> None:
        """Every rank opens the cache `prepare_data` wrote (memory-mapped: ranks share its pages)."""
        if self.trainer is not None:
            self.method = self.trainer.lightning_module
        if stage in ("fit", None) and self.train_dataset is None:
            cache = corpus_cache_path(*self._corpus_cache_args())
            if not cache.exists():
                raise SentEmbUserError(
                    f"{cache}: the tokenized training corpus is not there; `prepare_data` writes it before `setup` "
                    "(on local rank 0 of every node, or with data.prepare_data_per_node false on the first node only: "
                    "then data.cache_dir must be a folder every node sees); if that process failed, its own "
                    "error, above, names the cause"
                )
            self.train_dataset = open_tokenized_corpus(cache)
            self.method.collator.check_columns(self.train_dataset.column_names, self.train_path())
            self._check_one_batch()

    def _corpus_cache_args(self) -> tuple:
        """(corpus, tokenizer, max tokens, cache dir, max examples, negate) of the training cache, after
        refusing options that cannot train."""
        specials = self.method.encoder.format.num_special_tokens
        self._check_training_options(specials)
        return (self.train_path(), self.method.tokenizer, self.hparams.max_seq_len - specials, self.hparams.cache_dir,
                self.hparams.max_train_examples, self.hparams.negate)

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

    def train_dataloader(self) -> TrainLoader:
        trainer, examples = self.trainer, len(self.train_dataset)
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = ResumableBatchSampler(examples, self.hparams.batch_size, self.method.run_seed, replicas, rank)
        sampler.resume(self.batches_done)
        pin_memory = torch.cuda.is_available() if self.hparams.pin_memory is None else self.hparams.pin_memory
        loader = TrainLoader(self.train_dataset, sampler, self.method.collator, self.hparams.num_workers, pin_memory,
                             self.hparams.persistent_workers)
        if trainer is not None:
            loader.batches_trained = lambda: trainer.fit_loop.epoch_loop.batch_progress.total.processed
        self.train_loader = loader
        return loader

    def teardown(self, stage: str) -> None:
        """Stop the training loader's workers as the fit ends. Lightning stops the workers of the
        DataLoaders it is handed, but it sees ours through `TrainLoader`: with `persistent_workers` they
        lived on, holding memory, until the garbage collector broke the trainer's reference cycle, and a
        collection during a later fit in the same process (a sweep, the test suite) then waited on them
        for minutes."""
        self._stop_workers()

    def on_exception(self, exception: BaseException) -> None:
        """The same for a fit that stops on an exception (SIGTERM's exit, a divergence, Ctrl+C): Lightning
        skips `teardown` then."""
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self.train_loader is not None:
            self.train_loader.close()
            self.train_loader = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The data position of checkpoints written before `TrainLoader` kept it (they still resume
        exactly)."""
        self.batches_done = state_dict.get("batches_done", 0)

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
