"""Which examples train together: the seeded shuffle of each epoch and `group_by_length`, one rule for the
in-memory sampler (`steps.BatchSampler`) and for each worker's stream (`stream.StreamedBatches`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Item = TypeVar("Item")

# Batches sorted by length together (HF Trainer's megabatch): wide enough that a batch pads little, narrow
# enough that an epoch's order stays random at the scale of the whole dataset.
MEGABATCH = 50


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch: a new order each epoch, the same on every worker and every rerun."""
    return seed * 1_000_003 + epoch


def group_by_length(
    items: Sequence[Item],
    batch_size: int,
    length: Callable[[Item], int],
    permutation: Callable[[int], list[int]],
) -> list[list[Item]]:
    """`items` (already shuffled) cut into batches of similar length: each run of `MEGABATCH` batches is
    sorted by length before it is cut, then the batches are put in the order `permutation(number of
    batches)`, so consecutive steps do not walk from long chats to short ones."""
    mega = MEGABATCH * batch_size
    by_length = [x for m in range(0, len(items), mega) for x in sorted(items[m : m + mega], key=length)]
    batches = [by_length[b : b + batch_size] for b in range(0, len(by_length), batch_size)]
    return [batches[b] for b in permutation(len(batches))]
