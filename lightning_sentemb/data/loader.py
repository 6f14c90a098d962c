"""The training loader: a resumable, DDP-sharded batch sampler and the DataLoader around it.

The rank layout of a global batch is written here once (`rank_rows`, `gathered_position`): rank r takes
every world-size-th example of the global batch from r, as `DistributedSampler` does; what gathers the
ranks' rows back into the global batch's order (`distributed.gather_strided_rows`, MixCSE's
`example_order`) reads it from here.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset


class Collator(Protocol):
    """A method's collator as the loaders use it (`methods.collator.Collator`; the data layer sits below
    the methods and does not import them)."""

    generator: torch.Generator

    def __call__(self, examples: list[Any]) -> dict[str, Any]: ...

    def check_columns(self, columns: list[str], source: str) -> None: ...


def batch_seed(*key: int) -> int:
    """A 63-bit seed drawn from integers (run seed, epoch, rank, batch): unrelated for nearby keys."""
    return int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0] >> np.uint64(1))


def rank_rows(global_batch: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank `rank`'s rows of a global batch: every world_size-th from its rank (as `DistributedSampler`)."""
    return global_batch[rank::world_size]


def gathered_position(total: int, world_size: int, share: int | None = None,
                      device: torch.device | None = None) -> Tensor:
    """Where row c of a global batch of `total` rows (laid out by `rank_rows`) sits once every rank's rows,
    each padded to `share` rows (default: the largest share), are concatenated in rank order: rank
    c % world_size's row c // world_size. Made on `device` (no copy to it)."""
    rows = torch.arange(total, device=device)
    return rows % world_size * (share or -(-total // world_size)) + rows // world_size


def shuffled(num_examples: int, *key: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """A permutation of the examples seeded by `key`: a tensor (8 or 4 bytes an example), each batch's
    indices made Python ints only when it is drawn."""
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(batch_seed(*key)), dtype=dtype)


def local_batch(order: Tensor, index: int, global_size: int, rank: int, world_size: int) -> list[int]:
    """This rank's examples of global batch `index` of a shuffled `order`."""
    return rank_rows(order[index * global_size : (index + 1) * global_size], rank, world_size).tolist()


class ResumableBatchSampler:
    """Shuffled training batches that can start mid-epoch, DDP-sharded.

    Epoch e's order is a permutation seeded by (seed, e), the same on every rank; global batch b is its
    b-th run of batch_size × world_size examples, of which rank r takes every world_size-th from r
    (`rank_rows`); the incomplete last global batch is dropped. `resume(batches_done)` (batches trained
    since the run began) starts at the epoch and batch where those end, so a resumed run sees exactly
    the remaining ones.

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
        return self.num_examples // (self.num_replicas * self.batch_size)

    def first_batch(self) -> int:
        """The batch of this epoch to start at: the resume point's in the epoch it resumes, else 0."""
        return self.resume_point[1] if self.resume_point[0] == self.epoch else 0

    def __iter__(self) -> Iterator[list[tuple[int, Any]]]:
        epoch, world = self.epoch, self.num_replicas
        order = shuffled(self.num_examples, self.seed, epoch)
        for b in range(self.first_batch(), len(self)):
            seed = batch_seed(self.seed, epoch, self.rank, b)
            yield [(seed, i) for i in local_batch(order, b, self.batch_size * world, self.rank, world)]


class SeededExamples(Dataset):
    """`dataset[i]` for the sampler's (batch seed, i) keys, the seed passed along to `collate`."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, Any]:
        seed, index = key
        return seed, self.dataset[index]


class SeededCollate:
    """Seeds the method's collator's `generator` with the batch's seed, then calls the collator
    (`methods.collator.Collator`: what a worker start pickles, never the module); a mixture's batch gets
    its examples' dataset as `batch["dataset"]`."""

    def __init__(self, collator: Collator) -> None:
        self.collator = collator

    def __call__(self, items: list[tuple[int, Any]]) -> dict[str, Any]:
        self.collator.generator.manual_seed(items[0][0])
        examples = [example for _, example in items]
        batch = self.collator(examples)
        if "mixture" in examples[0]:  # a mixture's batch: its dataset (`data.mixture.MixtureSource`), for the step
            batch.setdefault("dataset", examples[0]["mixture"])
        return batch


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
