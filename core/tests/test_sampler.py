"""The EpochSampler (stratagem.engine.sampler) and the loaders that get one (stratagem.engine.data): one order
per epoch whatever the world size, dealt so that what the ranks consumed is a prefix of it, begun at any sample,
padded or cut at the end as torch's DistributedSampler is. The Trainer's resumes on it are in test_resume.py and
test_resume_world_size.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

from stratagem.engine.data import distribute_loader
from stratagem.engine.sampler import EpochSampler


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _ranks(
    n: int, world: int, *, shuffle: bool = True, start: int = 0, epoch: int = 0, **kw
) -> list[list[int]]:
    shares = []
    for rank in range(world):
        sampler = EpochSampler(_data(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7, **kw)
        sampler.set_epoch(epoch, start=start)
        shares.append(list(sampler))
        assert len(sampler) == len(shares[-1])
    return shares


def _order(n: int, epoch: int = 0) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(7 + epoch)).tolist()


def _taken(shares: list[list[int]], batch: int, batches: int) -> list[int]:
    """What the ranks consumed together after ``batches`` batches of ``batch`` each, in the epoch's order."""
    dealt = [share[: batch * batches] for share in shares]
    return [sample for row in itertools.zip_longest(*dealt) for sample in row if sample is not None]


def test_from_the_epochs_start_the_order_is_torchs_distributed_samplers() -> None:
    # A run that never changes its world size sees the order it saw before EpochSampler replaced it.
    for n, world, shuffle, drop_last, epoch in itertools.product(
        (64, 61, 3), (2, 3, 4), (True, False), (False, True), (0, 5)
    ):
        for rank in range(world):
            theirs = DistributedSampler(
                _data(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
            )
            theirs.set_epoch(epoch)
            ours = EpochSampler(
                _data(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
            )
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs), (n, world, shuffle, drop_last, epoch, rank)
            assert len(ours) == len(theirs)


def test_what_the_ranks_consumed_is_a_prefix_of_one_order_at_every_world_size() -> None:
    n = 64
    order = _order(n, epoch=3)
    assert order != _order(n, epoch=4) and sorted(order) == list(range(n))
    for world, batch in itertools.product((1, 2, 3, 4), (1, 3, 4)):
        shares = _ranks(n, world, epoch=3)
        for batches in range(n // (batch * world) + 1):
            assert _taken(shares, batch, batches) == order[: batches * batch * world], (world, batch, batches)


def test_begun_at_any_sample_the_epoch_goes_on_from_there_at_any_world_size() -> None:
    n = 64
    order = _order(n)
    for world, start in itertools.product((1, 2, 4), (0, 8, 20, 24, 36, 64)):
        shares = _ranks(n, world, start=start)
        # Even positions from an even start: no padding, each sample of the epoch exactly once.
        assert _taken(shares, 1, len(shares[0])) == order[start:], (world, start)
        sampler = EpochSampler(_data(n), num_replicas=world, rank=0, shuffle=True, seed=7)
        sampler.set_epoch(0, start=start)
        for taken in (0, 1, 3):
            assert sampler.consumed(taken) == min(start + taken * world, n)
        assert sampler.consumed(len(sampler)) == n
    # Stopped at 20 samples by a run of batches of 4 on 1 process, resumed on 2 with batches of 8 a process:
    # its first batch begins inside one of its own, and holds the next 16 samples of the order.
    shares = _ranks(n, 2, start=20)
    assert sorted(shares[0][:8] + shares[1][:8]) == sorted(order[20:36])
    assert order[:20] + _taken(shares, 8, 3) == order


def test_what_remains_is_padded_or_cut_as_at_an_epochs_start() -> None:
    n = 64
    order = _order(n)
    # 3 ranks from sample 20: 44 remain, 1 short of 3 x 15; the epoch's first sample again.
    shares = _ranks(n, 3, start=20)
    assert [len(share) for share in shares] == [15, 15, 15]
    assert _taken(shares, 1, 15) == order[20:] + order[:1]  # order[0] was consumed before the resume
    # drop_last: the last 44 % 3 = 2 positions are left out instead.
    shares = _ranks(n, 3, start=20, drop_last=True)
    assert [len(share) for share in shares] == [14, 14, 14]
    assert _taken(shares, 1, 14) == order[20:62]
    # In order (no shuffle), and a data set smaller than the padding it needs.
    assert _ranks(64, 3, shuffle=False, start=62) == [[62], [63], [0]]
    assert _ranks(2, 4, shuffle=False, start=1) == [[1], [0], [1], [0]]


def test_a_start_outside_the_epoch_is_refused() -> None:
    sampler = EpochSampler(_data(10), num_replicas=2, rank=0, shuffle=True)
    for start in (-1, 11, 2.0, True):
        with pytest.raises(
            ValueError, match=r"set_epoch\(start=.*\): give the number of samples of the epoch"
        ):
            sampler.set_epoch(0, start=start)  # type: ignore[arg-type]


def test_loaders_that_take_their_data_in_order_or_shuffled_get_one_at_every_world_size() -> None:
    data = _data(10)
    for world in (1, 2):
        kwargs = {"num_replicas": world, "rank": world - 1}
        for shuffle in (True, False):
            loader = distribute_loader(DataLoader(data, batch_size=4, shuffle=shuffle), kwargs, seed=3)
            sampler = loader.sampler
            assert isinstance(sampler, EpochSampler) and isinstance(sampler, DistributedSampler)
            assert (sampler.shuffle, sampler.seed, sampler.num_replicas, sampler.rank) == (
                shuffle,
                3,
                world,
                world - 1,
            )
        # The loader's generator is kept for what else the loader draws (its workers' seeds), not for the order:
        # the order is the seed's at every world size.
        generator = torch.Generator().manual_seed(11)
        loader = distribute_loader(DataLoader(data, batch_size=4, shuffle=True, generator=generator), kwargs)
        assert loader.generator is generator
        plain = distribute_loader(DataLoader(data, batch_size=4, shuffle=True), kwargs)
        assert list(loader.sampler) == list(plain.sampler)
    # A sampler of the user's own, drawn with replacement, or a batch sampler of the user's own: left alone
    # where one process needs no split; with several, a RandomSampler is replaced as before.
    drawn = DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True))
    assert distribute_loader(drawn, {"num_replicas": 1, "rank": 0}) is drawn
    assert isinstance(distribute_loader(drawn, {"num_replicas": 2, "rank": 0}).sampler, EpochSampler)
    batched = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, drop_last=False))
    for world in (1, 2):
        assert distribute_loader(batched, {"num_replicas": world, "rank": 0}) is batched
