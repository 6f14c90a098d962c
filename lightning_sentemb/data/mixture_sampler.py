"""One dataset a batch: the mixture's resumable batch sampler.

An epoch is `sum(b_d)` global batches, b_d = the full global batches (batch_size × world size) dataset d
holds: the number of batches its datasets give, whatever the sampling. The sampling decides how many of
them each dataset draws (`allocation`) and in what order:

- `proportional`: b_d each (p ∝ size × weight), in a seeded random order: with weights 1, every example of
  every dataset once an epoch;
- `temperature`: p_d ∝ weight × b_d^α (`data.mixture_alpha`; α < 1 raises the small datasets' share, as
  E5 and mT5 do), counts rounded by largest remainder, in a seeded random order;
- `round_robin`: datasets in turn, 0, 1, ..., D-1, 0, ... (weights must be 1).

Each dataset is read as its own endless stream of passes: pass k is a permutation seeded by (seed, d, k),
read global batch after global batch (its incomplete last one dropped); a dataset that runs out (drawn more
often than it has batches, as a small dataset under `temperature` or `round_robin`) starts its next pass,
reshuffled; one drawn less reads on from where it stood at the next epoch. Dataset d's position after
epoch e is e × c_d: the whole state is the number of batches done, as for one file, so a resume is exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..errors import SentEmbUserError
from .loader import ResumableBatchSampler, batch_seed, local_batch, shuffled

SAMPLINGS = ("proportional", "round_robin", "temperature")
SCHEDULE_KEY, PASS_KEY = 0x6D6978, 0x70617373  # streams of draws apart from the epochs' and batches' seeds


def allocation(batches: Sequence[int], weights: Sequence[float], sampling: str, alpha: float) -> np.ndarray:
    """Each dataset's global batches in an epoch of `sum(batches)` (see the module docstring)."""
    total, datasets = sum(batches), len(batches)
    if sampling == "round_robin":
        return np.bincount(np.arange(total) % datasets, minlength=datasets)
    exponent = alpha if sampling == "temperature" else 1.0
    share = np.asarray(weights, dtype=np.float64) * np.asarray(batches, dtype=np.float64) ** exponent
    quota = np.round(total * share / share.sum(), 9)  # an exact quota stays exact through the division
    counts = np.floor(quota).astype(np.int64)
    counts[np.argsort(counts - quota, kind="stable")[: total - int(counts.sum())]] += 1
    return counts


def check_sampling(sampling: str, alpha: float, weights: Sequence[float]) -> None:
    """One line for a sampling the mixture cannot follow."""
    if sampling not in SAMPLINGS:
        raise SentEmbUserError(f"data.mixture_sampling is {sampling!r}; use one of {', '.join(SAMPLINGS)}")
    if sampling == "temperature" and not 0 < alpha <= 1:
        raise SentEmbUserError(f"data.mixture_alpha is {alpha}: temperature sampling takes 0 < α <= 1 "
                               "(p ∝ size^α; 1 is proportional, E5's 0.5 evens small datasets out)")
    if sampling == "round_robin" and any(w != 1 for w in weights):
        raise SentEmbUserError("data.datasets: round_robin sampling takes every dataset in turn and reads no "
                               "weight; drop the weights or use proportional or temperature sampling")


class MixtureBatchSampler(ResumableBatchSampler):
    """Global batches of one dataset each, DDP-sharded as one file's (`loader.local_batch`): each item of
    a batch is (batch seed, (dataset, example)). `set_epoch` / `resume` / the batch seeds as
    `ResumableBatchSampler`; its length is the epoch of the module docstring."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], sampling: str, alpha: float, batch_size: int,
                 seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        self.sizes = list(sizes)
        self.batches = [size // (batch_size * num_replicas) for size in self.sizes]
        check_sampling(sampling, alpha, weights)
        self.sampling = sampling
        self.counts = allocation(self.batches, weights, sampling, alpha)
        super().__init__(sum(self.sizes), batch_size, seed, num_replicas, rank)

    def __len__(self) -> int:
        return sum(self.batches)

    def schedule(self, epoch: int) -> np.ndarray:
        """The dataset of each global batch of the epoch: `counts[d]` batches of dataset d."""
        if self.sampling == "round_robin":
            return np.arange(len(self)) % len(self.sizes)
        datasets = np.repeat(np.arange(len(self.sizes)), self.counts)
        return datasets[shuffled(len(datasets), self.seed, SCHEDULE_KEY, epoch).numpy()]

    def __iter__(self) -> Iterator[list[tuple[int, tuple[int, int]]]]:
        epoch, world, first = self.epoch, self.num_replicas, self.first_batch()
        schedule = self.schedule(epoch)
        drawn = epoch * self.counts + np.bincount(schedule[:first], minlength=len(self.sizes))
        orders: dict[int, tuple[int, torch.Tensor]] = {}  # dataset -> (pass, its order): one pass a dataset held
        for b in range(first, len(self)):
            d = int(schedule[b])
            passes, index = divmod(int(drawn[d]), self.batches[d])
            if orders.get(d, (None,))[0] != passes:
                orders[d] = passes, shuffled(self.sizes[d], self.seed, PASS_KEY, d, passes, dtype=torch.int32)
            drawn[d] += 1
            seed = batch_seed(self.seed, epoch, self.rank, b)
            yield [(seed, (d, i)) for i in local_batch(orders[d][1], index, self.batch_size * world, self.rank, world)]
