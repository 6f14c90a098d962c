"""The mixture's batch sampler (`data.mixture_sampler`): each epoch's allocation by hand, one dataset a global
batch split across ranks as one file's, passes that reshuffle, and a resume that continues exactly; the rank
layout written once (`data.loader`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_sentemb.data.loader import ResumableBatchSampler, gathered_position, rank_rows
from lightning_sentemb.data.mixture_sampler import MixtureBatchSampler, allocation
from lightning_sentemb.errors import SentEmbUserError

SIZES = [42, 13, 5]  # batch 4: 10, 3 and 1 full batches an epoch (the rest dropped)


def sampler(sampling: str = "proportional", batch_size: int = 4, world: int = 1, rank: int = 0, alpha: float = 0.5,
            weights=(1, 1, 1)) -> MixtureBatchSampler:
    return MixtureBatchSampler(SIZES, weights, sampling, alpha, batch_size, seed=11, num_replicas=world, rank=rank)


def epochs(batches: MixtureBatchSampler, count: int, start: int = 0) -> list[list]:
    out = []
    for epoch in range(start, count):
        batches.set_epoch(epoch)
        out += list(batches)
    return out


def test_each_epoch_draws_the_allocation_computed_by_hand():
    # temperature 0.5: √10, √3, √1 of 14 batches = 7.51, 4.11, 2.37 -> 7, 4, 2 and the largest remainder (.51) +1
    expected = {"proportional": [10, 3, 1], "temperature": [8, 4, 2], "round_robin": [5, 5, 4]}
    for sampling, counts in expected.items():
        batches = sampler(sampling)
        assert len(batches) == 14 and batches.counts.tolist() == counts
        for epoch in range(3):
            assert np.bincount(batches.schedule(epoch), minlength=3).tolist() == counts
    assert sampler("round_robin").schedule(0).tolist() == [0, 1, 2] * 4 + [0, 1]
    assert sampler("proportional").schedule(0).tolist() != sampler("proportional").schedule(1).tolist()  # reshuffled
    # weights scale the shares: 2 x 10 : 3 : 1 of 14 -> 11.67, 1.75, .58 -> 11, 1, 0 + remainders (.75, .67) -> 12, 2, 0
    assert allocation([10, 3, 1], [2, 1, 1], "proportional", 1.0).tolist() == [12, 2, 0]
    assert allocation([10, 3, 1], [1, 1, 1], "temperature", 1.0).tolist() == [10, 3, 1]


def test_every_batch_is_one_dataset_and_each_pass_reads_a_dataset_once():
    batches = sampler("temperature")  # the 1-batch dataset drawn twice an epoch, the 10-batch one 8 times
    drawn: dict[int, list[list[int]]] = {0: [], 1: [], 2: []}
    for batch in epochs(batches, 3):
        (d,) = {key[1][0] for key in batch}
        assert len({seed for seed, _ in batch}) == 1 and len(batch) == 4
        drawn[d].append([key[1][1] for key in batch])
    for d, rows in drawn.items():
        full = SIZES[d] // 4
        assert len(rows) == 3 * batches.counts[d]
        for start in range(0, len(rows) - full + 1, full):  # a pass: b_d batches of distinct examples
            seen = [i for batch in rows[start:start + full] for i in batch]
            assert len(set(seen)) == len(seen) and max(seen) < SIZES[d]
    # the small dataset ran out within the epoch and restarted, reshuffled: its passes differ
    assert drawn[2][0] != drawn[2][1]
    # the large one, drawn 8 of its 10 batches an epoch, goes on where it stood: no repeat before 10 batches
    assert len({i for batch in drawn[0][:10] for i in batch}) == 40


def test_ranks_split_the_global_batch_of_one_process():
    one = epochs(sampler(batch_size=8), 2)
    ranks = [epochs(sampler(batch_size=4, world=2, rank=r), 2) for r in range(2)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 12  # 42, 13, 5 examples: 5 + 1 + 0 global batches of 8
    for whole, first, second in zip(one, *ranks, strict=True):
        keys = [key for _, key in whole]
        assert [key for _, key in first] == keys[0::2] and [key for _, key in second] == keys[1::2]


@pytest.mark.parametrize("sampling", ["proportional", "temperature", "round_robin"])
def test_a_resume_continues_exactly(sampling):
    full = epochs(sampler(sampling), 3)
    for done in (0, 5, 14, 20, 41):
        resumed = sampler(sampling)
        resumed.resume(done)
        assert epochs(resumed, 3, start=resumed.epoch) == full[done:]


def test_one_dataset_per_batch_is_a_plain_samplers_layout():
    """A dataset's global batches split across ranks exactly as one file's (`ResumableBatchSampler`)."""
    plain = [ResumableBatchSampler(42, 4, seed=3, num_replicas=2, rank=r) for r in range(2)]
    whole = ResumableBatchSampler(42, 8, seed=3)
    for b, (first, second, both) in enumerate(zip(*plain, whole, strict=True)):
        keys = [i for _, i in both]
        assert [i for _, i in first] == keys[0::2] and [i for _, i in second] == keys[1::2], b


@pytest.mark.parametrize(("total", "world"), [(8, 2), (7, 2), (10, 3), (5, 1)])
def test_gathered_position_inverts_the_rank_layout(total, world):
    rows = torch.arange(total)
    share = -(-total // world)
    padded = [torch.cat([part, part.new_full((share - len(part),), -1)]) for part in
              (rank_rows(rows, r, world) for r in range(world))]
    assert torch.equal(torch.cat(padded)[gathered_position(total, world)], rows)


def test_sampling_errors_are_one_line():
    with pytest.raises(SentEmbUserError, match="data.mixture_sampling is 'random'; use one of proportional"):
        sampler("random")
    with pytest.raises(SentEmbUserError, match="data.mixture_alpha is 0"):
        sampler("temperature", alpha=0)
    with pytest.raises(SentEmbUserError, match="round_robin sampling .* reads no weight"):
        sampler("round_robin", weights=(2, 1, 1))
