"""Which samples a dp rank reads for a training step: one row arithmetic for the loader's own
thread, its worker processes and a sharded stream.

Step k's global batch is positions [k*G, (k+1)*G) of the data order; dp rank r of D takes
[r*G/D, (r+1)*G/D) and cuts it into microbatches of local_batch_size rows. So the rows of step k
are the same for every (dp_degree, local_batch_size) with the same G. The data order is a token
store's samples under a fresh permutation each epoch (`PermutedOrder`), or a dp rank's own share
of a stream (`titanlite.data.stream`), whose positions count that share alone (D = 1, r = 0).
"""

import numpy as np
import torch

from titanlite.data import shuffle


def microbatch_rows(
    step: int, microbatch: int, dp_rank: int, *, dp_degree, num_microbatches, local_batch_size
) -> tuple[int, int]:
    """[start, stop): the positions in the data order of microbatch `microbatch` of dp rank
    `dp_rank` in global step `step`."""
    per_rank = num_microbatches * local_batch_size
    start = (step * dp_degree + dp_rank) * per_rank + microbatch * local_batch_size
    return start, start + local_batch_size


class PermutedOrder:
    """Global sample positions -> cached samples, a fresh permutation each epoch (computed per
    position, titanlite.data.shuffle: no per-sample table, whatever the corpus size)."""

    def __init__(self, get, lo: int, hi: int, seed: int):
        self.get, self.lo, self.n, self.seed = get, lo, hi - lo, seed

    def samples(self, start: int, stop: int) -> np.ndarray:
        """The cache's sample indices at positions [start, stop) of the data order."""
        return self.samples_at(np.arange(start, stop, dtype=np.int64))

    def samples_at(self, positions: np.ndarray) -> np.ndarray:
        """The cache's sample indices at these positions of the data order (ascending)."""
        epochs, within = np.divmod(positions, self.n)
        samples = np.empty_like(positions)
        for epoch in np.unique(epochs):  # a step's rows span few epochs
            at = epochs == epoch
            samples[at] = shuffle.permutation(self.n, self.seed, int(epoch))(within[at])
        return self.lo + samples

    def take(self, start: int, stop: int) -> list[np.ndarray]:
        return [self.get(int(i)) for i in self.samples(start, stop)]


class Microbatches(torch.utils.data.Dataset):
    """Item (step, i) -> microbatch i of one dp rank's rows of global step `step`, collated by
    `make_batch`; `order.take(start, stop)` reads the rows. The loader's thread asks for the
    items of a step in turn, worker processes get them from a torch DataLoader: the same rows."""

    def __init__(
        self, order, make_batch, *, dp_rank, dp_degree, num_microbatches, local_batch_size
    ):
        self.order, self.make_batch = order, make_batch
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.num_microbatches, self.local_batch_size = num_microbatches, local_batch_size

    def rows(self, step: int, microbatch: int) -> tuple[int, int]:
        return microbatch_rows(
            step, microbatch, self.dp_rank, dp_degree=self.dp_degree,
            num_microbatches=self.num_microbatches, local_batch_size=self.local_batch_size,
        )  # fmt: skip

    def __getitem__(self, item: tuple[int, int]):
        return self.make_batch(self.order.take(*self.rows(*item)))
