"""SentEmbDataModule: a training corpus (or a mixture of them) plus the STS evaluation sets."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset

from ..errors import SentEmbUserError
from ..evaluation import parse_evaluators
from .corpus import corpus_cache_path, open_tokenized_corpus, tokenize_corpus
from .instructions import E5_FORMAT
from .loader import ResumableBatchSampler, TrainLoader
from .mixture import DatasetSpec, MixtureDataset, parse_datasets
from .mixture_sampler import MixtureBatchSampler, check_sampling
from .paths import MissingDataError, require_file, resolve_data_dir
from .senteval import DEV_TASKS, STS_SUBSETS, STS_TASKS, StsTask, load_sts_task
from .senteval_corpora import training_file


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


class SentEmbDataModule(LightningDataModule):
    """Training corpus + STS evaluation sets.

    Args:
        train_file: one sentence a line (`.txt`) or SimCSE's NLI csv (`sent0,sent1,hard_neg`, or
            `hard_neg_1..hard_neg_k` as `sentemb data mine` writes); a relative path is looked up under `data_dir`.
            `senteval:sts`: the unlabeled sentences of the STS sets under `data_dir` (ConSERT's corpus,
            `data.sts_corpus`; other `senteval:` corpora: `data.senteval_corpora`). Unused with `datasets`.
        datasets: a mixture of training datasets, one dataset a global batch: name -> {path, format, columns,
            weight, instruction, in_batch_negatives, query_max_len, doc_max_len} (`data.mixture`, docs/data.md).
        mixture_sampling: which dataset each batch draws: `proportional` (by size × weight), `temperature`
            (p ∝ weight × size^mixture_alpha) or `round_robin` (`data.mixture_sampler`).
        mixture_alpha: the exponent of `temperature` sampling.
        instruction_format: how a dataset's instruction is written before its queries, `{instruction}` then
            the text (E5-mistral's `Instruct: {instruction}\nQuery: ` by default; docs/mixtures.md).
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
        datasets: dict[str, Any] | None = None,
        mixture_sampling: str = "proportional",
        mixture_alpha: float = 0.5,
        instruction_format: str = E5_FORMAT,
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
        # the training datasets: data.datasets, or data.train_file as a mixture of one, read as a plain corpus
        self.mixture = datasets is not None
        self.specs = parse_datasets(datasets) if self.mixture else [DatasetSpec("train_file", train_file)]
        if self.mixture:
            check_sampling(mixture_sampling, mixture_alpha, [spec.weight for spec in self.specs])
        self.method = None
        self.train_dataset = None
        self.batches_done = 0
        self.train_loader: TrainLoader | None = None

    @property
    def data_dir(self):
        return resolve_data_dir(self.hparams.data_dir)

    def train_path(self, spec: DatasetSpec | None = None) -> str:
        """The file of a training dataset (default: the first, `data.train_file` without a mixture)."""
        try:
            return training_file((spec or self.specs[0]).path, self.data_dir, self.hparams.cache_dir)
        except MissingDataError as missing:
            raise missing.for_option("--data.data_dir") from None

    def source_label(self, spec: DatasetSpec) -> str:
        """How errors name a training dataset: its file, and its name in a mixture."""
        return f"data.datasets.{spec.name} ({self.train_path(spec)})" if self.mixture else self.train_path(spec)

    def check_data(self, stage: str) -> None:
        """Fail with the missing path and the fetch command before a run (and its W&B run) starts:
        the training corpora for `fit`, the STS sets the stage evaluates."""
        try:
            if stage == "fit":
                for spec in self.specs:
                    require_file(self.train_path(spec), "training corpus")
            for name in self.test_tasks if stage == "test" else self.val_tasks:
                load_sts_task(name, self.data_dir)
        except MissingDataError as missing:
            raise missing.for_option("--data.data_dir") from None

    def prepare_data(self) -> None:
        """Tokenize each training corpus into its cache file, before `setup`. Lightning calls this in
        one process per node (local rank 0; with `prepare_data_per_node` false, in one process of
        the job) and holds the other ranks at a barrier until it is done."""
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self.method = trainer.lightning_module
            for spec in self.specs:
                tokenize_corpus(*self._corpus_cache_args(spec), workers=self.hparams.tokenize_workers,
                                columns=spec.columns)

    def setup(self, stage: str | None = None) -> None:
        """Every rank opens the caches `prepare_data` wrote (memory-mapped: ranks share their pages)."""
        if self.trainer is not None:
            self.method = self.trainer.lightning_module
        if stage in ("fit", None) and self.train_dataset is None:
            datasets = [self._open(spec) for spec in self.specs]
            tokenizer = self.method.tokenizer
            sources = [s.source(i, tokenizer, self.hparams.instruction_format) for i, s in enumerate(self.specs)]
            for source in sources if self.mixture else ():  # what the method does not apply: one line, now
                self.method.check_source(source)
            self.train_dataset = MixtureDataset(datasets, sources) if self.mixture else datasets[0]

    def _open(self, spec: DatasetSpec) -> Any:
        cache = corpus_cache_path(*self._corpus_cache_args(spec), columns=spec.columns)
        if not cache.exists():
            raise SentEmbUserError(
                f"{cache}: the tokenized training corpus is not there; `prepare_data` writes it before `setup` "
                "(on local rank 0 of every node, or with data.prepare_data_per_node false on the first node only: "
                "then data.cache_dir must be a folder every node sees); if that process failed, its own "
                "error, above, names the cause"
            )
        dataset = open_tokenized_corpus(cache)
        spec.check_columns(dataset.column_names, self.train_path(spec))
        self.method.collator.check_columns(dataset.column_names, self.source_label(spec))
        self._check_one_batch(dataset, spec)
        return dataset

    def _corpus_cache_args(self, spec: DatasetSpec) -> tuple:
        """(corpus, tokenizer, max tokens, cache dir, max examples, negate) of a dataset's cache, after
        refusing options that cannot train."""
        specials = self.method.encoder.format.num_special_tokens
        self._check_training_options(specials)
        return (self.train_path(spec), self.method.tokenizer, spec.limits(self.hparams.max_seq_len, specials),
                self.hparams.cache_dir, self.hparams.max_train_examples, self.hparams.negate)

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

    def _check_one_batch(self, dataset: Any, spec: DatasetSpec) -> None:
        """Training drops the last incomplete batch: a corpus smaller than one batch per device would
        train nothing and still end 'successfully' (in a mixture, its dataset would never be drawn)."""
        devices = self.trainer.world_size if self.trainer is not None else 1
        if len(dataset) < self.hparams.batch_size * devices:
            raise SentEmbUserError(
                f"{self.source_label(spec)}: {len(dataset)} training example(s), fewer than one batch "
                f"(data.batch_size {self.hparams.batch_size} x {devices} device(s)); use a larger corpus "
                "(or a larger data.max_train_examples) or a smaller --data.batch_size"
            )

    def train_dataloader(self) -> TrainLoader:
        trainer, hp = self.trainer, self.hparams
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        if self.mixture:
            sampler = MixtureBatchSampler(self.train_dataset.sizes, [spec.weight for spec in self.specs],
                                          hp.mixture_sampling, hp.mixture_alpha, hp.batch_size, self.method.run_seed,
                                          replicas, rank)
        else:
            sampler = ResumableBatchSampler(len(self.train_dataset), hp.batch_size, self.method.run_seed, replicas,
                                            rank)
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
