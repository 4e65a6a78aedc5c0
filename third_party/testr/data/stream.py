"""Training pictures drawn on the fly: an endless, seeded stream of mapped batches, made in worker processes so the
training loop (on a GPU or on the CPU's threads) never waits on drawing, decoding or mapping.

Batch b holds records b*B … b*B+B-1 of `draw` (index → detectron2 dataset dict, e.g. a synthetic set's picture drawn
in memory), resized with sizes drawn from a generator seeded by (seed, b): the stream is the same whatever the number
of workers, and a run resumed at batch b goes on with exactly the batches it would have seen.
"""
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class RecordStream(IterableDataset):
    def __init__(self, draw, mapper, batch: int, seed: int = 0, start: int = 0):
        self.draw, self.mapper, self.batch, self.seed, self.start = draw, mapper, batch, seed, start

    def batch_at(self, b: int) -> list:
        np.random.seed([self.seed, b])  # detectron2's augmentations draw from numpy's global generator
        return [self.mapper(self.draw(b * self.batch + i)) for i in range(self.batch)]

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if info:
            torch.set_num_threads(1)  # a worker draws; the training process computes
        b = self.start + worker  # the loader takes one batch from each worker in turn: batches stay in order
        while True:
            yield self.batch_at(b)
            b += workers


def _as_is(batch):
    return batch


def stream(draw, mapper, batch: int, seed: int = 0, start: int = 0, workers: int = 2):
    """An iterator of batches (lists of mapped records) from batch `start` on, drawn by `workers` processes (0: in
    this one)."""
    loader = DataLoader(RecordStream(draw, mapper, batch, seed, start), batch_size=None, num_workers=workers,
                        collate_fn=_as_is, prefetch_factor=4 if workers else None, persistent_workers=bool(workers))
    return iter(loader)
