"""One order per epoch for the whole data set, whatever the world size, dealt out to the data-parallel ranks and
begun at any sample of the epoch: what lets a run stopped mid-epoch go on at another world size or per-process
batch without seeing a sample twice or missing one."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class EpochSampler(DistributedSampler):
    """The sampler the Engine gives loaders that take their data set in order or shuffled, at every world size.

    An epoch's order is the data set's indices in order or, shuffled, one permutation drawn from
    ``seed + epoch`` alone: the draw torch's ``DistributedSampler`` makes, so that a run that keeps its world
    size sees the order it saw under that sampler. Its positions from ``start`` on are dealt to the ranks in
    turn (rank ``r`` takes positions ``start + r``, ``start + r + num_replicas``, ...): once every rank has
    taken ``k`` samples, the ranks together have taken positions ``start`` to ``start + k * num_replicas``,
    the same samples at any world size.

    Every rank takes as many samples, so that no rank runs out of batches before the others: when
    ``num_replicas`` does not divide what remains of the epoch, the last positions are filled with the
    epoch's first samples again (``drop_last=False``: fewer than ``num_replicas`` are seen twice), or the last
    ``remaining % num_replicas`` are left out (``drop_last=True``), as ``DistributedSampler`` does.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.size = len(dataset)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch whose order to deal, from its position ``start`` on: the samples of the epoch that the
        ranks have consumed together (a checkpoint's ``samples_in_epoch``). Each call sets both."""
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= self.size:
            raise ValueError(
                f"EpochSampler.set_epoch(start={start!r}): give the number of samples of the epoch consumed "
                f"so far, from 0 to the data set's {self.size}."
            )
        self.epoch, self.start = epoch, start
        remaining = self.size - start
        if self.drop_last:
            self.num_samples = remaining // self.num_replicas
        else:
            self.num_samples = math.ceil(remaining / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def order(self) -> list[int]:
        """This epoch's order of the whole data set (every rank's share of it, from position 0)."""
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        dealt = order[self.start :]
        missing = self.total_size - len(dealt)
        if missing > 0:  # padding: the epoch's first samples again, around as often as a tiny data set needs
            dealt += (order * math.ceil(missing / max(len(order), 1)))[:missing]
        return iter(dealt[self.rank : self.total_size : self.num_replicas])

    def consumed(self, taken: int) -> int:
        """The samples of the epoch the ranks have consumed once each has taken ``taken`` of its share."""
        return min(self.start + min(taken, self.num_samples) * self.num_replicas, self.size)
